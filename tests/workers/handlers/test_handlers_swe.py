"""The `swe` handler: SWE-bench records validated, the repository checked out in a sandbox,
the agent's diff collected, and patches graded in a fresh bubblewrap box by swebench's own
parser and grading functions."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.settings import get_settings
from sandbox.keeper import launch, release
from sandbox.reaper import GRADING_DIR
from sandbox.statedir import remove_tree
from sandbox.toolclient import ToolClient
from tests.support.procs import processes_mentioning
from tests.support.sandbox import find_job_processes
from tests.support.swe import BUILDER, bwrap_problem
from workers.handlers.base import TaskValidationError
from workers.handlers.registry import get_handler
from workers.handlers.swe.grading import grade_log, swebench_spec
from workers.handlers.swe.handler import SweHandler
from workers.handlers.swe.task import SOURCE_INSIDE, SweEnvironmentError, read_task

ROOT = Path(__file__).resolve().parents[3]
HANDLER = SweHandler()


JOB = f"swe-grade-test-{uuid.uuid4().hex[:12]}"
"""The id of the job graded here: this module's own, so that its leftover check sees only
its own processes (other modules grade beside it)."""

needs_bwrap = pytest.mark.skipif(
    bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
)


@pytest.fixture(autouse=True)
def repo_roots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Host repositories are allowed from the temporary directory, where every test here
    builds them."""
    monkeypatch.setenv("ROLLSERVE_SWE_REPO_ROOTS", os.path.realpath(tempfile.gettempdir()))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def built_tasks() -> Iterator[dict[str, dict[str, Any]]]:
    """The example tasks, built once into a directory of their own; by example name."""
    out = Path(tempfile.mkdtemp(prefix="swe-tasks-"))
    tasks = BUILDER.build(out)
    yield {example.name: task for example, task in zip(BUILDER.EXAMPLES, tasks, strict=True)}
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def sandbox_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short sandbox dir for the settings grading reads; nothing may be left in it."""
    root = Path(tempfile.mkdtemp(prefix="rs-swe-", dir="/tmp"))
    monkeypatch.setenv("ROLLSERVE_SANDBOX_BACKEND", "bwrap")
    monkeypatch.setenv("ROLLSERVE_SANDBOX_DIR", str(root))
    monkeypatch.setenv("ROLLSERVE_TOOL_TIMEOUT", "60")
    get_settings.cache_clear()  # the settings are read once per process
    yield root
    get_settings.cache_clear()
    left = [p for p in (root / GRADING_DIR).glob("*") if not p.name.startswith(".")]
    remove_tree(root)
    assert left == [], f"grading boxes left behind: {left}"
    assert processes_mentioning(JOB) == []


def example(name: str) -> Any:
    [found] = [e for e in BUILDER.EXAMPLES if e.name == name]
    return found


def patch_from_edits(task: dict[str, Any], edits: tuple[Any, ...], tmp_path: Path) -> str:
    """The diff the edits make to the task's repository at its base commit."""
    work = tmp_path / "work"
    subprocess.run(
        ["git", "clone", "-q", task["environment"]["repo_path"], str(work)],
        check=True,
        env=BUILDER.GIT_ENV | {"PATH": "/usr/bin:/bin"},
    )
    BUILDER.apply_edits(work, edits)
    patch: str = BUILDER.staged_diff(work)
    return patch


def grade(task: dict[str, Any], patch: str | None) -> Any:
    outcome = None if patch is None else {"patch": patch}
    return HANDLER.grade(task, [], outcome=outcome, job_id=JOB)


# ----------------------------------------------------------------------------- validation


def test_the_handler_is_registered_for_swe() -> None:
    assert isinstance(get_handler("swe"), SweHandler)


def test_every_built_task_validates(built_tasks: dict[str, dict[str, Any]]) -> None:
    for task in built_tasks.values():
        HANDLER.validate(task)


def test_test_lists_may_be_lists_or_json_strings(built_tasks: dict[str, dict[str, Any]]) -> None:
    task = built_tasks["textkit"]
    as_lists = {
        **task,
        "FAIL_TO_PASS": json.loads(task["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.loads(task["PASS_TO_PASS"]),
    }
    assert read_task(as_lists) == read_task(task)
    assert read_task(task).fail_to_pass == ["tests/test_slug.py::test_no_separator_at_either_end"]


def _without(task: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k != key}


BAD_FIELDS = [
    ("base_commit", lambda t: _without(t, "base_commit")),
    ("base_commit", lambda t: {**t, "base_commit": "main"}),
    ("problem_statement", lambda t: {**t, "problem_statement": "  "}),
    ("test_patch", lambda t: _without(t, "test_patch")),
    ("patch", lambda t: {**t, "patch": 3}),
    ("FAIL_TO_PASS", lambda t: {**t, "FAIL_TO_PASS": "[not json"}),
    ("FAIL_TO_PASS", lambda t: {**t, "FAIL_TO_PASS": []}),
    ("PASS_TO_PASS", lambda t: {**t, "PASS_TO_PASS": [1, 2]}),
    ("PASS_TO_PASS", lambda t: _without(t, "PASS_TO_PASS")),
    ("environment", lambda t: _without(t, "environment")),
    ("environment", lambda t: {**t, "environment": {}}),
    ("environment.repo_path", lambda t: {**t, "environment": {"repo_path": "repos/x"}}),
    ("environment.image", lambda t: {**t, "environment": {"image": ""}}),
    ("environment.python", lambda t: {**t, "environment": {**t["environment"], "python": "py"}}),
    ("environment.test_cmd", lambda t: {**t, "environment": {**t["environment"], "test_cmd": 1}}),
    ("timeout", lambda t: {**t, "timeout": 0}),
    ("eval_type", lambda t: {**t, "eval_type": "sometimes"}),
    ("log_parser", lambda t: {**t, "log_parser": "my_parser"}),
]


@pytest.mark.parametrize(("field", "corrupt"), BAD_FIELDS, ids=[f for f, _ in BAD_FIELDS])
def test_a_bad_field_is_named(
    built_tasks: dict[str, dict[str, Any]], field: str, corrupt: Any
) -> None:
    with pytest.raises(TaskValidationError) as error:
        HANDLER.validate(corrupt(copy.deepcopy(built_tasks["textkit"])))
    assert error.value.field == field


def test_an_image_environment_needs_no_host_repository(
    built_tasks: dict[str, dict[str, Any]],
) -> None:
    task = {**built_tasks["textkit"], "environment": {"image": "docker://swebench/x"}}
    parsed = read_task(task)
    assert parsed.source == "/testbed"
    assert parsed.test_cmd == "python -m pytest -rA"
    spec = HANDLER.sandbox_spec(task, "job-1")
    assert spec.root == "docker://swebench/x"
    assert spec.binds == []
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD" not in spec.env


def test_the_prompt_gives_the_issue_and_where_the_repository_is(
    built_tasks: dict[str, dict[str, Any]],
) -> None:
    system, user = HANDLER.initial_messages(built_tasks["intervals"])
    assert system["role"] == "system" and "finish" in system["content"]
    assert "/workspace" in user["content"]
    assert "merge() returns overlapping intervals" in user["content"]
    assert HANDLER.tools(built_tasks["intervals"])


def test_a_turn_without_a_tool_call_gets_a_reminder(built_tasks: dict[str, dict[str, Any]]) -> None:
    step = HANDLER.step(built_tasks["intervals"], "I think the bug is in merge.", 0)
    assert not step.done
    assert "finish" in step.messages[0]["content"]


def test_the_sandbox_binds_a_repository_made_for_the_job_read_only(
    built_tasks: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSERVE_SANDBOX_DIR", str(tmp_path / "boxes"))
    get_settings.cache_clear()
    spec = HANDLER.sandbox_spec(built_tasks["textkit"], "job-1")
    [bind] = spec.binds
    # not the host repository itself (it may hold the task's future), but one made for the job
    assert str(bind.host) != built_tasks["textkit"]["environment"]["repo_path"]
    assert (
        Path(bind.host).is_relative_to(tmp_path / "boxes") and (Path(bind.host) / "HEAD").is_file()
    )
    assert bind.inside == SOURCE_INSIDE and bind.read_only
    assert spec.env["PATH"].startswith(str(Path(sys.executable).parent))


def test_a_repo_path_that_is_not_a_repository_fails_the_sandbox(
    built_tasks: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    task = {**built_tasks["textkit"], "environment": {"repo_path": str(tmp_path)}}
    with pytest.raises(SweEnvironmentError, match="not a git repository"):
        HANDLER.sandbox_spec(task, "job-1")


# ----------------------------------------------------------------------------- grading logs


def make_log(lines: list[str], exit_code: int | None = 1, markers: bool = True) -> str:
    body = "\n".join(lines)
    if not markers:
        return body + "\n"
    log = f"+ git apply -v -\n+ : '>>>>> Start Test Output'\n{body}\n+ : '>>>>> End Test Output'\n"
    if exit_code is not None:
        log += f">>>>> Test Exit Code: {exit_code}\n"
    return log


F2P = "tests/test_slug.py::test_no_separator_at_either_end"
P2P = [
    "tests/test_slug.py::test_words_are_joined_with_dashes",
    "tests/test_slug.py::test_accents_are_dropped",
    "tests/test_slug.py::test_custom_separator",
    "tests/test_case.py::test_camel_to_snake",
    "tests/test_case.py::test_snake_to_camel",
]
LOGS = {
    "all-pass": make_log([f"PASSED {t}" for t in [F2P, *P2P]], exit_code=0),
    "f2p-fails": make_log(
        [f"PASSED {t}" for t in P2P] + [f"FAILED {F2P} - AssertionError: assert '-x-' == 'x'"]
    ),
    "p2p-missing": make_log([f"PASSED {t}" for t in [F2P, *P2P[:3]]], exit_code=0),
    "p2p-error": make_log(
        [f"PASSED {t}" for t in [F2P, *P2P[1:]]] + [f"ERROR {P2P[0]} - ImportError"]
    ),
    "no-markers": make_log([f"PASSED {t}" for t in [F2P, *P2P]], markers=False),
    "exit-code-disagrees": make_log([f"PASSED {t}" for t in [F2P, *P2P]], exit_code=2),
    "empty": make_log(["collected 0 items"], exit_code=5),
}


@pytest.mark.parametrize("name", list(LOGS))
def test_grading_a_log_agrees_with_swebench(
    built_tasks: dict[str, dict[str, Any]], name: str
) -> None:
    from swebench.harness.grading import get_eval_report

    task = read_task(built_tasks["textkit"])
    ours = grade_log(task, LOGS[name])
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "test_output.txt"
        path.write_text(LOGS[name])
        prediction = {"instance_id": task.instance_id, "model_patch": "diff", "model_name": "m"}
        theirs = get_eval_report(swebench_spec(task), prediction, str(path), True)
    [report] = theirs.values()
    assert ours.resolved == report["resolved"]
    assert ours.parsed == report["patch_successfully_applied"]
    if ours.parsed:
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            assert ours.tests[key] == report["tests_status"][key]


def test_a_log_naming_every_test_passed_is_resolved(built_tasks: dict[str, dict[str, Any]]) -> None:
    report = grade_log(read_task(built_tasks["textkit"]), LOGS["all-pass"])
    assert report.resolution == "RESOLVED_FULL"
    assert report.exit_code == 0


def test_a_log_missing_a_pass_to_pass_test_is_not_resolved(
    built_tasks: dict[str, dict[str, Any]],
) -> None:
    report = grade_log(read_task(built_tasks["textkit"]), LOGS["p2p-missing"])
    assert not report.resolved
    assert report.tests["PASS_TO_PASS"]["failure"] == P2P[3:]


# ----------------------------------------------------------------------------- grading patches


@needs_bwrap
@pytest.mark.parametrize("name", [e.name for e in BUILDER.EXAMPLES])
def test_the_gold_patch_resolves_the_task(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, name: str
) -> None:
    result = grade(built_tasks[name], built_tasks[name]["patch"])
    assert result.reward == 1.0, result.details
    details = result.details
    assert details["resolution"] == "RESOLVED_FULL"
    assert details["patch_applied"] is True
    assert details["FAIL_TO_PASS"]["failure"] == [] and details["PASS_TO_PASS"]["failure"] == []
    assert ">>>>> End Test Output" in details["log_tail"]


@needs_bwrap
@pytest.mark.parametrize("name", [e.name for e in BUILDER.EXAMPLES])
def test_at_the_base_commit_the_fail_to_pass_tests_fail(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, name: str
) -> None:
    task = built_tasks[name]
    result = grade(task, None)
    assert result.reward == 0.0
    assert result.details["patch_is_empty"] is True
    assert result.details["FAIL_TO_PASS"]["failure"] == json.loads(task["FAIL_TO_PASS"])
    assert result.details["PASS_TO_PASS"]["failure"] == []
    assert "no patch" in result.details["reason"]


@needs_bwrap
def test_a_wrong_patch_gets_no_reward_and_the_failing_test_is_named(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, tmp_path: Path
) -> None:
    task = built_tasks["textkit"]
    result = grade(task, patch_from_edits(task, example("textkit").wrong, tmp_path))
    assert result.reward == 0.0
    assert result.details["patch_applied"] is True
    assert result.details["FAIL_TO_PASS"]["failure"] == [F2P]
    assert F2P in result.details["reason"]


@needs_bwrap
def test_a_patch_that_breaks_a_pass_to_pass_test_gets_no_reward(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, tmp_path: Path
) -> None:
    task = built_tasks["calendarx"]
    result = grade(task, patch_from_edits(task, example("calendarx").wrong, tmp_path))
    assert result.reward == 0.0
    assert result.details["FAIL_TO_PASS"]["failure"] == []
    assert result.details["PASS_TO_PASS"]["failure"] == [
        "tests/test_century.py::test_every_fourth_century_is_leap"
    ]
    assert "PASS_TO_PASS failing" in result.details["reason"]


@needs_bwrap
def test_a_patch_that_does_not_apply_gets_no_reward_and_says_so(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path
) -> None:
    task = built_tasks["textkit"]
    # The line it removes is not in the file: no fuzz makes that apply.
    removed = '-    return re.sub(r"[\\s_-]+", separator, text)'
    stale = task["patch"].replace(removed, "-    return text")
    assert stale != task["patch"]
    result = grade(task, stale)
    assert result.reward == 0.0
    assert result.details["patch_applied"] is False
    assert result.details["reason"] == (
        "the patch does not apply: patch failed: textkit/slug.py:12; "
        "textkit/slug.py: patch does not apply"
    )
    tried = [attempt["command"] for attempt in result.details["patch_apply"]]
    assert tried[0] == "git apply --verbose"
    assert tried[-1] == "git apply --check --reverse"
    assert result.details["FAIL_TO_PASS"]["failure"] == [F2P]


@needs_bwrap
def test_the_model_cannot_change_the_tests_that_grade_it(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, tmp_path: Path
) -> None:
    task = built_tasks["textkit"]
    cheat = BUILDER.Edit(
        "tests/test_slug.py",
        'assert slugify("Hello World") == "hello-world"',
        "assert True",
    )
    result = grade(task, patch_from_edits(task, (cheat,), tmp_path))
    assert result.reward == 0.0
    assert result.details["patch_applied"] is True
    assert result.details["FAIL_TO_PASS"]["failure"] == [F2P]


@needs_bwrap
def test_tests_that_never_end_are_stopped_at_the_task_timeout(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path, tmp_path: Path
) -> None:
    task = {**built_tasks["textkit"], "timeout": 4}
    hang = BUILDER.Edit(
        "textkit/slug.py", '    """The lower-case', '    while True:\n        pass\n    """The'
    )
    result = grade(task, patch_from_edits(task, (hang,), tmp_path))
    assert result.reward == 0.0
    assert result.details["timed_out"] is True
    assert result.details["seconds"] < 15


# ----------------------------------------------------------------------------- INIT and RUN


@needs_bwrap
def test_the_workspace_is_checked_out_and_the_diff_is_the_outcome(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path
) -> None:
    task = built_tasks["calendarx"]
    job_id = f"swe-handler-test-{uuid.uuid4().hex[:12]}"
    kept = launch(HANDLER.sandbox_spec(task, job_id), "bwrap", sandbox_dir)
    try:
        with ToolClient(kept.socket_path, timeout=60) as tools:
            HANDLER.prepare(task, tools)
            status = tools.call("bash", command="git status --short; git log --format=%H")
            assert status["output"].strip() == task["base_commit"]
            assert not tools.call("bash", command="git remote")["output"].strip()
            # The fix by the editor, and a new file, made in the agent's own shell.
            tools.call(
                "editor",
                command="str_replace",
                path="/workspace/calendarx/leap.py",
                old_str="    return year % 4 == 0\n",
                new_str="    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
            )
            tools.call("bash", command="cd /tmp && echo 'CENTURY = 100' > /workspace/NOTES.py")
            outcome = HANDLER.collect_outcome(task, tools)
    finally:
        release(kept)
    assert sorted(outcome["changed_files"]) == ["NOTES.py", "calendarx/leap.py"]
    assert "+CENTURY = 100" in outcome["patch"]
    assert task["patch"].split("index ")[1].split("\n", 1)[1] in outcome["patch"]
    assert find_job_processes(job_id) == []
    result = HANDLER.grade(task, [], outcome=outcome, job_id=job_id)
    assert result.reward == 1.0, result.details


@needs_bwrap
def test_a_workspace_without_git_gives_an_empty_patch_and_the_reason(
    built_tasks: dict[str, dict[str, Any]], sandbox_dir: Path
) -> None:
    task = built_tasks["intervals"]
    kept = launch(HANDLER.sandbox_spec(task, "swe-handler-nogit"), "bwrap", sandbox_dir)
    try:
        with ToolClient(kept.socket_path, timeout=60) as tools:
            HANDLER.prepare(task, tools)
            tools.call("bash", command="rm -rf /workspace/.git")
            outcome = HANDLER.collect_outcome(task, tools)
    finally:
        release(kept)
    assert outcome["patch"] == ""
    assert "not a git repository" in outcome["error"]
