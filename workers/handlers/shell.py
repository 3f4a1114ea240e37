"""`shell` tasks: an instruction carried out with tools in a sandbox, graded by a check command.

A task: `{"data_source": "shell", "instruction": "...", "check": "bash that exits 0 when done",
"files": {"/workspace/path": "content", ...}, "network": false}`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sandbox.base import SandboxSpec
from workers.handlers.base import Grade, Handler, StepResult, TaskValidationError, ToolSession
from workers.tool_specs import ALL_TOOLS

SYSTEM = (
    "You are an agent working in a Linux sandbox. Your working directory is /workspace. "
    "Use the tools to carry out the task, then call finish."
)
REMINDER = "Call a tool to work on the task, or call finish when it is done."


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
        files = task.get("files", {})
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and k.startswith("/workspace/") and isinstance(v, str)
            for k, v in files.items()
        ):
            raise TaskValidationError("files", "must map paths under /workspace/ to text")
        if not isinstance(task.get("network", False), bool):
            raise TaskValidationError("network", "must be true or false")

    def sandbox_spec(self, task: dict[str, Any], job_id: str) -> SandboxSpec:
        return SandboxSpec(job_id=job_id, network=bool(task.get("network", False)))

    def prepare(self, task: dict[str, Any], tools: ToolSession) -> None:
        for path, content in task.get("files", {}).items():
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
    ) -> Grade:
        if tools is None:
            raise RuntimeError("a shell task is graded in its sandbox, and it has none")
        result = tools.call("bash", command=task["check"], timeout=float(task.get("timeout", 60)))
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
