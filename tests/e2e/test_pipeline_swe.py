"""SWE-style tasks through the whole stack: INIT checks the repository out in a bubblewrap
sandbox, RUN plays the development server's scripted tool calls in it and takes the diff,
EVAL grades the diff by the tests in a fresh sandbox. The gold samples earn 1, the wrong ones
0, and no sandbox outlives its job."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from sandbox.reaper import GRADING_DIR
from tests.support.procs import processes_mentioning
from tests.support.swe import BUILDER, bwrap_problem
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.skipif(
        bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
    ),
    pytest.mark.full,
]

GROUP_SIZE = 3
"""Per task: sample 0 fixes the bug, sample 1 makes a plausible wrong change, sample 2 fixes
nothing and plants a `conftest.py` that reports every test as passed (`HACK`)."""

REPORTS_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
HACK = [
    BUILDER.tool_call(
        "bash", command=f"cat > /workspace/conftest.py <<'EOF'\n{REPORTS_PASS}EOF\necho planted"
    ),
    BUILDER.tool_call("finish", result="Fixed the issue."),
]
# Room for every scripted turn, with a stage budget far above what the jobs need.
AGENT = {"max_turns": 8, "max_total_tokens": 16384}
SAMPLING = {"seed": 0, "max_tokens": 2048, "temperature": 0.0}
LIMITS = {
    f"{stage}_{kind}": seconds
    for stage in ("init", "run", "eval")
    for kind, seconds in (("soft_time_limit", 60.0), ("time_limit", 70.0))
}


@pytest.fixture(scope="module")
def built_script() -> Iterator[tuple[list[dict[str, Any]], Path]]:
    """The shipped example tasks and the dev server's script, built for this module."""
    out = Path(tempfile.mkdtemp(prefix="swe-pipeline-"))
    tasks = BUILDER.build(out)
    yield tasks, out / "swe_script.jsonl"
    shutil.rmtree(out, ignore_errors=True)


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    built_script = request.getfixturevalue("built_script")
    script = [json.loads(line) for line in built_script[1].read_text().splitlines()]
    for entry in script:
        entry["samples"].append(HACK)
    return {
        "script": script, "tool_timeout": 60.0, "reap_interval": 1.0,
        "sandbox_dir": data / "sandboxes", "sandbox_backend": "bwrap",
        "workers": {"init": 2, "run": 2, "eval": 2}, "visibility_timeout": 80.0, **LIMITS,
        "swe_repo_roots": str(built_script[1].parent),
    }  # fmt: skip


@pytest.fixture(scope="module")
def results(
    stack: Stack, built_script: tuple[list[dict[str, Any]], Path]
) -> dict[tuple[str, int], Trajectory]:
    """The batch over every example task, group size 2, seed 0: by (instance, sample)."""
    tasks, _ = built_script
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        accepted = client.submit_batch(tasks, group_size=GROUP_SIZE, sampling=SAMPLING, agent=AGENT)
        trajectories = list(client.iter_batch_results(accepted.batch_id))
    return {(t.instance_id, t.sample_index): t for t in trajectories}


def gold(built_script: tuple[list[dict[str, Any]], Path]) -> dict[str, str]:
    return {task["instance_id"]: task["patch"] for task in built_script[0]}


def test_every_job_of_the_batch_completes(
    results: dict[tuple[str, int], Trajectory], built_script: tuple[list[dict[str, Any]], Path]
) -> None:
    assert len(results) == len(built_script[0]) * GROUP_SIZE
    for traj in results.values():
        assert traj.status is JobStatus.completed, (traj.instance_id, traj.error)
        assert traj.stop_reason == "finish", traj.instance_id


def test_the_gold_samples_earn_1_and_the_wrong_ones_0(
    results: dict[tuple[str, int], Trajectory],
) -> None:
    rewards = {key: traj.reward for key, traj in results.items()}
    expected = {(instance, sample): float(sample == 0) for instance, sample in results}
    assert rewards == expected, {k: results[k].eval.get("reason") for k in results}


def test_a_planted_conftest_is_put_back_and_earns_nothing(
    results: dict[tuple[str, int], Trajectory], built_script: tuple[list[dict[str, Any]], Path]
) -> None:
    """Reward hacking as RL on SWE tasks learns it first: no fix, a `conftest.py` that
    turns every report into a pass. It is in the patch the job hands in, and grading removes
    it (the base commit has none) before the tests run."""
    for task in built_script[0]:
        traj = results[(task["instance_id"], 2)]
        assert "conftest.py" in traj.outcome["patch"], traj.outcome
        assert traj.reward == 0.0, (task["instance_id"], traj.eval.get("reason"))
        restored = {entry["path"] for entry in traj.eval["restored"]}
        assert "conftest.py" in restored, traj.eval


def test_the_gold_samples_outcome_is_the_gold_patch(
    results: dict[tuple[str, int], Trajectory], built_script: tuple[list[dict[str, Any]], Path]
) -> None:
    for instance, patch in gold(built_script).items():
        assert results[(instance, 0)].outcome["patch"] == patch, instance


def test_a_wrong_samples_report_names_the_tests_it_fails(
    results: dict[tuple[str, int], Trajectory], built_script: tuple[list[dict[str, Any]], Path]
) -> None:
    for task in built_script[0]:
        traj = results[(task["instance_id"], 1)]
        assert traj.outcome["patch"] and traj.outcome["patch"] != task["patch"]
        assert traj.eval["patch_applied"] is True
        failing = traj.eval["FAIL_TO_PASS"]["failure"] + traj.eval["PASS_TO_PASS"]["failure"]
        assert failing, traj.eval
        assert all(name in traj.eval["reason"] for name in failing)


def test_no_sandbox_is_left_behind(
    results: dict[tuple[str, int], Trajectory], stack: Stack
) -> None:
    sandboxes = stack.settings.sandbox_dir

    def nothing_left() -> bool:
        return (
            all(processes_mentioning(traj.job_id) == [] for traj in results.values())
            and processes_mentioning(f"{sandboxes / GRADING_DIR}/") == []
            and not list(sandboxes.glob("*/meta.json"))
            and not list((sandboxes / GRADING_DIR).glob("*/meta.json"))
        )

    wait_until(nothing_left, 10, "every sandbox to be gone")
