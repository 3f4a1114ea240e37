"""Code tasks end to end: the development server plays a correct program as sample 0 and a
wrong one as sample 1 (one of them never ends), EVAL grades each in a fresh bubblewrap box,
and only the correct programs earn a reward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus
from deploy.stack import Stack
from sandbox.bwrap import BubblewrapBackend
from tests.support.procs import processes_mentioning

pytestmark = pytest.mark.full

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def read_jsonl(name: str) -> list[dict[str, Any]]:
    lines = (EXAMPLES / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    ok, why = BubblewrapBackend().available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    return {
        "script": read_jsonl("code_script.jsonl"),
        "workers": {"init": 1, "run": 2, "eval": 2},
        "sandbox_dir": data / "sandboxes",
        "sandbox_backend": "bwrap",
    }


def test_a_batch_of_code_tasks_rewards_exactly_the_correct_programs(stack: Stack) -> None:
    tasks = read_jsonl("code_tasks.jsonl")
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        accepted = client.submit_batch(tasks, group_size=2, sampling={"seed": 0, "max_tokens": 512})
        results = list(client.iter_batch_results(accepted.batch_id))

    assert len(results) == 2 * len(tasks)
    rewards: dict[str, dict[int, float | None]] = {}
    for traj in results:
        assert traj.status is JobStatus.completed, (traj.instance_id, traj.error)
        assert traj.stop_reason == "answer"
        rewards.setdefault(str(traj.instance_id), {})[traj.sample_index] = traj.reward
    assert rewards == {str(task["instance_id"]): {0: 1.0, 1: 0.0} for task in tasks}

    endless = next(t for t in results if t.instance_id == "code-sum-max" and t.sample_index == 1)
    assert endless.eval["tests"][0]["verdict"] == "time limit"

    grading_root = stack.settings.sandbox_dir / ".grading"
    # A grading box's processes name its directory under the stack's own grading root.
    assert processes_mentioning(f"{grading_root}/") == []
    assert [p.name for p in grading_root.iterdir() if not p.name.startswith(".")] == []
