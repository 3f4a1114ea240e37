"""`shell` tasks: an instruction carried out with tools in a sandbox, graded by a check command.

A task: `{"data_source": "shell", "instruction": "...", "check": "bash that exits 0 when done",
"files": {"/workspace/path": "content", ...}, "network": false, "egress": [], "timeout": 60}`.
`files` are written into the sandbox before the episode (paths are normalised and must stay
inside `/workspace`); `timeout` is the check's time limit in seconds. With
`"grading": {"isolated": true, "files": {...}}` the check runs in a fresh box instead, holding
a copy of the agent's final workspace and then the grading files
(`workers.handlers.isolated`). With `"network": true`
the box has a network of its own that reaches only the hosts `egress` names (`"pypi.org"`,
`"example.org:8443"`; without a port, 443 and 80), each of which the operator's
`ROLLSERVE_SANDBOX_EGRESS_ALLOW` must allow; they hold from the box's start until the agent's
turns are over (grading reaches no host outside).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any, ClassVar

from core.egress import EgressRuleError, HostRule, parse_task_rules, uncovered
from sandbox.base import SandboxSpec
from workers.handlers.base import Grade, Handler, StepResult, TaskValidationError, ToolSession
from workers.handlers.boxlimits import box_limits
from workers.handlers.gradingbox import check_command, grading_place
from workers.handlers.isolated import (
    IsolatedGrading,
    WorkspaceNotCopied,
    copy_out_workspace,
    grade_isolated,
    read_grading,
)
from workers.tool_specs import ALL_TOOLS

SYSTEM = (
    "You are an agent working in a Linux sandbox. Your working directory is /workspace. "
    "Use the tools to carry out the task, then call finish."
)
REMINDER = "Call a tool to work on the task, or call finish when it is done."

WORKSPACE = "/workspace"
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 3600.0
"""Longest `timeout` a task may give its check, in seconds."""
MAX_NAME_BYTES = 255
"""Longest file name (one path component) a file system takes."""
MAX_PATH_BYTES = 4095
"""Longest path a file system call takes."""


def workspace_path(raw: Any, where: str) -> str:
    """`raw` as a normalised absolute path inside /workspace, or a `TaskValidationError`."""
    if not isinstance(raw, str):
        raise TaskValidationError(where, "must map paths (strings) to text")
    if "\x00" in raw:
        raise TaskValidationError(where, f"path {raw!r} holds a NUL character")
    path = posixpath.normpath(raw)
    if path.startswith("//"):  # normpath keeps a leading double slash
        path = "/" + path.lstrip("/")
    if not raw.startswith("/") or not path.startswith(WORKSPACE + "/"):
        raise TaskValidationError(
            where, f"path {raw!r} is not inside {WORKSPACE}/ (as {path!r}, once normalised)"
        )
    if len(path.encode()) > MAX_PATH_BYTES or any(
        len(part.encode()) > MAX_NAME_BYTES for part in path.split("/")
    ):
        raise TaskValidationError(where, f"path {raw!r} is too long for a file system")
    return path


def task_files(task: dict[str, Any]) -> dict[str, str]:
    """The task's `files` by their normalised paths; a `TaskValidationError` for a path
    outside /workspace, two paths naming one file, or a file where another needs a directory."""
    return checked_files(task.get("files"), "files")


def checked_files(files: Any, where: str) -> dict[str, str]:
    """`files` (a mapping of paths under /workspace to text, or None) by normalised paths,
    checked as `task_files` says; errors name `where`."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise TaskValidationError(where, "must map paths under /workspace/ to text")
    found: dict[str, str] = {}
    for raw, content in files.items():
        path = workspace_path(raw, where)
        if not isinstance(content, str):
            raise TaskValidationError(where, f"the content of {raw!r} must be text")
        if path in found:
            raise TaskValidationError(where, f"path {raw!r} names a file given twice")
        found[path] = content
    for path in found:
        parent = posixpath.dirname(path)
        while parent != WORKSPACE:
            if parent in found:
                why = f"{parent!r} is a file, so it cannot hold {path!r}"
                raise TaskValidationError(where, why)
            parent = posixpath.dirname(parent)
    return found


def task_egress(task: dict[str, Any], cap: Sequence[HostRule]) -> list[str]:
    """The hosts the task's box may connect to (its `egress`: `host` or `host:port` each), every
    one within the operator's `cap`; a `TaskValidationError` naming `egress` otherwise."""
    raw = task.get("egress")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TaskValidationError("egress", "must be a list of host names (`host` or `host:port`)")
    if raw and task.get("network") is not True:
        raise TaskValidationError("egress", 'needs "network": true')
    try:
        rules = parse_task_rules(raw)
    except EgressRuleError as exc:
        raise TaskValidationError("egress", str(exc)) from None
    outside = uncovered(rules, cap)
    if outside:
        names = ", ".join(str(rule) for rule in outside)
        raise TaskValidationError(
            "egress",
            f"{names}: not among the hosts this service lets sandboxes reach "
            "(ROLLSERVE_SANDBOX_EGRESS_ALLOW)",
        )
    return list(dict.fromkeys(str(rule) for rule in rules))


def check_timeout(task: dict[str, Any]) -> float:
    """The check's time limit: the task's `timeout` in seconds, or the default."""
    value = task.get("timeout")
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TaskValidationError("timeout", "must be a number of seconds")
    if not 0 < value <= MAX_TIMEOUT:  # exact for any int; false for NaN
        raise TaskValidationError("timeout", f"must be more than 0 and at most {MAX_TIMEOUT:g}")
    return float(value)


class ShellHandler(Handler):
    """Tool use in a sandbox; reward 1.0 when the task's check command exits 0."""

    name: ClassVar[str] = "shell"
    needs_sandbox: ClassVar[bool] = True
    grades_in_sandbox: ClassVar[bool] = True

    def validate(self, task: dict[str, Any]) -> None:
        for key in ("instruction", "check"):
            value = task.get(key)
            if not isinstance(value, str) or not value.strip():
                raise TaskValidationError(key, "must be a non-empty string")
        task_files(task)
        if not isinstance(task.get("network", False), bool):
            raise TaskValidationError("network", "must be true or false")
        task_egress(task, self.settings.sandbox_egress_cap)
        box_limits(task, self.settings)
        check_timeout(task)
        read_grading(task, checked_files)

    def sandbox_spec(self, task: dict[str, Any], job_id: str) -> SandboxSpec:
        # Checked again here: the operator may have narrowed the cap since submission.
        egress = task_egress(task, self.settings.sandbox_egress_cap)
        limits = box_limits(task, self.settings)
        return SandboxSpec(
            job_id=job_id, network=bool(task.get("network", False)), egress=egress, limits=limits
        )

    def prepare(self, task: dict[str, Any], tools: ToolSession) -> None:
        for path, content in task_files(task).items():
            tools.call("editor", command="create", path=path, file_text=content)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["instruction"]},
        ]

    def tools(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return ALL_TOOLS

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        return StepResult(done=False, messages=[{"role": "user", "content": REMINDER}])

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        if tools is None:
            raise RuntimeError("a shell task is graded in its sandbox, and it has none")
        grading = read_grading(task, checked_files)
        if grading.isolated:
            return self._grade_isolated(task, tools, grading, job_id)
        # `tools` runs each command as a fresh bash over the halted box's files
        # (workers.freshshell): the agent's shell, functions and processes take no part.
        # And the check runs with a /tmp and a home of its own, Python and git told to
        # trust nothing of the workspace's for themselves (`check_command`).
        result = tools.call(
            "bash", command=check_command(task["check"]), timeout=check_timeout(task)
        )
        passed = result.get("exit_code") == 0
        return Grade(
            reward=1.0 if passed else 0.0,
            details={
                "check": task["check"],
                "exit_code": result.get("exit_code"),
                "timed_out": result.get("timed_out", False),
                "output": str(result.get("output", ""))[-2000:],
            },
        )

    def _grade_isolated(
        self, task: dict[str, Any], tools: ToolSession, grading: IsolatedGrading, job_id: str
    ) -> Grade:
        """The check in a fresh box holding a copy of the agent's workspace and the task's
        grading files (`workers.handlers.isolated`)."""
        try:
            workspace = copy_out_workspace(tools)
            return grade_isolated(
                self.sandbox_spec(task, job_id),
                grading_place(self.settings),
                workspace,
                grading,
                task["check"],
                check_timeout(task),
            )
        except WorkspaceNotCopied as exc:
            return Grade(0.0, {"check": task["check"], "isolated": True, "reason": str(exc)})
