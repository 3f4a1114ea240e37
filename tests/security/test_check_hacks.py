"""A `shell` check pays for the result, not for what the agent left to fool it.

Real bubblewrap boxes held by real keepers: the agent works through its tool server, the box
is halted, and the check runs as grading runs it (`ShellHandler.grade` over
`workers.freshshell`). Each attack leaves the task undone and plants something the check
would trust: a `json.py` shadowing the standard library, a git hook (in `.git/hooks` or
named by `core.hooksPath`) that makes the check's own `git checkout` lie, a `.pth` or
`usercustomize.py` in the user site of the box's shared home. The controls (undone: 0,
done: 1) hold alongside.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.bwrap import BubblewrapBackend
from sandbox.keeper import launch, release
from sandbox.statedir import remove_tree
from sandbox.toolclient import ToolClient
from workers.freshshell import FreshShell
from workers.handlers.base import Grade, TaskValidationError
from workers.handlers.shell import ShellHandler

HANDLER = ShellHandler()

JSON_CHECK = (
    'cd /workspace && python3 -c "import json, sys; '
    "sys.exit(0 if json.load(open('result.json'))['answer'] == 42 else 1)\""
)
"""Done when /workspace/result.json says the answer is 42."""

GIT_CHECK = "cd /workspace && git checkout -q HEAD -- expected.txt && cmp -s expected.txt out.txt"
"""Done when out.txt is expected.txt as committed (put back first, in case it was edited)."""

REPO = (
    "cd /workspace && git init -q && printf 'expected\\n' > expected.txt && git add . && "
    "git -c user.name=t -c user.email=t@t.invalid commit -qm base"
)

Run = Callable[[dict[str, Any], list[str]], Grade]


@pytest.fixture
def run_task() -> Iterator[Run]:
    """`run_task(task, commands)`: a box for `task`, the agent's `commands` run through its
    tool server, then the grade as EVAL makes it. Every box is released."""
    ok, why = BubblewrapBackend().available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    root = Path(tempfile.mkdtemp(prefix="rs-check-", dir="/tmp"))

    def run(task: dict[str, Any], commands: list[str]) -> Grade:
        job_id = f"check-hack-{uuid.uuid4().hex[:8]}"
        kept = launch(HANDLER.sandbox_spec(task, job_id), "bwrap", root)
        try:
            with ToolClient(kept.socket_path, timeout=60) as tools:
                HANDLER.prepare(task, tools)
                for command in commands:
                    out = tools.call("bash", command=command, timeout=30)
                    assert out["exit_code"] == 0, out
            shell = FreshShell(kept.as_dict())
            shell.halt()
            return HANDLER.grade(task, [], shell, {}, job_id=job_id)
        finally:
            release(kept)

    yield run
    remove_tree(root)


def shell_task(check: str) -> dict[str, Any]:
    return {"data_source": "shell", "instruction": "Do it.", "check": check, "timeout": 30}


# ----------------------------------------------------------------------------- controls


def test_an_undone_task_scores_zero(run_task: Run) -> None:
    assert run_task(shell_task(JSON_CHECK), []).reward == 0.0
    assert run_task(shell_task(GIT_CHECK), [REPO, "echo wrong > /workspace/out.txt"]).reward == 0


def test_a_done_task_scores_one(run_task: Run) -> None:
    done = "echo '{\"answer\": 42}' > /workspace/result.json"
    assert run_task(shell_task(JSON_CHECK), [done]).reward == 1.0
    copied = "cp /workspace/expected.txt /workspace/out.txt"
    assert run_task(shell_task(GIT_CHECK), [REPO, copied]).reward == 1.0


# ----------------------------------------------------------------------------- attacks


def test_a_module_in_the_workspace_does_not_shadow_the_standard_library(run_task: Run) -> None:
    shadow = "printf 'import os\\nos._exit(0)\\n' > /workspace/json.py"
    result = run_task(shell_task(JSON_CHECK), [shadow])
    assert result.reward == 0.0, result.details


@pytest.mark.parametrize(
    "hooks",
    [
        "mkdir -p /workspace/.git/hooks && cd /workspace/.git/hooks",
        "mkdir -p /workspace/tools && git -C /workspace config core.hooksPath tools && "
        "cd /workspace/tools",
    ],
    ids=["git-hooks", "core-hooksPath"],
)
def test_a_git_hook_does_not_run_in_the_check(run_task: Run, hooks: str) -> None:
    hook = (
        f"{hooks} && printf '#!/bin/sh\\ncp out.txt expected.txt\\n' > post-checkout && "
        "chmod +x post-checkout"
    )
    result = run_task(shell_task(GIT_CHECK), [REPO, "echo wrong > /workspace/out.txt", hook])
    assert result.reward == 0.0, result.details


@pytest.mark.parametrize(
    "name, text",
    [("rs.pth", "import os; os._exit(0)\n"), ("usercustomize.py", "import os\nos._exit(0)\n")],
)
def test_the_user_site_of_the_boxs_home_is_not_read(run_task: Run, name: str, text: str) -> None:
    plant = (
        'site="$(python3 -m site --user-site)" && mkdir -p "$site" && '
        f'printf %s {text!r} > "$site/{name}"'
    )
    result = run_task(shell_task(JSON_CHECK), [plant])
    assert result.reward == 0.0, result.details


def test_a_check_runs_with_a_home_and_tmp_of_its_own_and_trusts_nothing_by_default(
    run_task: Run,
) -> None:
    check = (
        'test "$HOME" != /tmp && test -z "$(ls -A "$HOME")" && test -z "$(ls -A "$TMPDIR")" && '
        'test "$PYTHONSAFEPATH" = 1 && test "$PYTHONNOUSERSITE" = 1 && '
        'test "$GIT_CONFIG_GLOBAL" = /dev/null && test "$GIT_CONFIG_NOSYSTEM" = 1 && '
        'test "$(git config core.hooksPath)" = /dev/null && '
        'test "$(git config core.fsmonitor)" = false && test "$(pwd)" = /workspace'
    )
    result = run_task(shell_task(check), [REPO, "git -C /workspace config core.fsmonitor true"])
    assert result.reward == 1.0, result.details


# ----------------------------------------------------------------------------- isolated grading

GRADER = (
    "import json, sys\n"
    "sys.exit(0 if json.load(open('/workspace/result.json'))['answer'] == 42 else 1)\n"
)
"""The task's own check program, brought in only at grading time."""


def isolated_task() -> dict[str, Any]:
    return {
        **shell_task("python3 /workspace/grade/check.py"),
        "grading": {"isolated": True, "files": {"/workspace/grade/check.py": GRADER}},
    }


def test_isolated_grading_pays_for_the_result_and_only_for_it(run_task: Run) -> None:
    unseen = "test ! -e /workspace/grade/check.py"  # the agent never sees the grader
    done = "echo '{\"answer\": 42}' > /workspace/result.json"
    result = run_task(isolated_task(), [unseen, done])
    assert result.reward == 1.0, result.details
    assert result.details["isolated"] is True
    assert run_task(isolated_task(), [unseen]).reward == 0.0


@pytest.mark.parametrize(
    "plant",
    [
        "mkdir -p /workspace/grade && printf 'raise SystemExit(0)\\n' > /workspace/grade/check.py",
        "mkdir -p /workspace/elsewhere && printf 'raise SystemExit(0)\\n' > "
        "/workspace/elsewhere/check.py && ln -s elsewhere /workspace/grade",
        "printf 'import os\\nos._exit(0)\\n' > /workspace/json.py",
        "touch /tmp/agent-was-here && mkdir -p /tmp/.local && echo x > /tmp/.local/x",
    ],
    ids=["grader-replaced", "grader-dir-linked", "json-shadowed", "tmp-left"],
)
def test_isolated_grading_runs_the_tasks_grader_not_the_agents(run_task: Run, plant: str) -> None:
    result = run_task(isolated_task(), [plant])
    assert result.reward == 0.0, result.details


def test_grading_files_need_isolated_grading_and_paths_in_the_workspace() -> None:
    with pytest.raises(TaskValidationError, match=r"grading\.files"):
        HANDLER.validate({**shell_task("true"), "grading": {"files": {"/workspace/x": "y"}}})
    with pytest.raises(TaskValidationError, match=r"grading\.files"):
        HANDLER.validate(
            {**shell_task("true"), "grading": {"isolated": True, "files": {"/etc/x": "y"}}}
        )
    with pytest.raises(TaskValidationError, match=r"grading\.isolated"):
        HANDLER.validate({**shell_task("true"), "grading": {"isolated": "yes"}})
    HANDLER.validate(isolated_task())
