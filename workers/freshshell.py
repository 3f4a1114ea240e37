"""What grading talks to: fresh processes over a job's box, never the agent's tool server.

Once the agent's turns are over, the job's box is halted (its keeper kills the tool server,
the agent's shell and whatever it left running; the files stay), and every command that
collects the outcome or decides the reward runs as a fresh process in a fresh box over the
same files (`sandbox.keeper.exec_fresh`): `bash --noprofile --norc -c CHECK`, with the box's
clean environment (a fixed `PATH`, no `BASH_ENV`, `ENV` or `PROMPT_COMMAND`, none of the
agent's functions, aliases, exported variables or working directory), a `/tmp` of its own
and its own timeout. Nothing the agent could have started, stopped or replaced answers.
"""

from __future__ import annotations

from typing import Any

from sandbox.base import EXEC_OUTPUT_LIMIT, ExecResult
from sandbox.keeper import exec_fresh, halt

DEFAULT_TIMEOUT = 120.0


class FreshShell:
    """A `ToolSession` over fresh processes in the job's halted box (`kept`: the job's
    `sandbox` record). Only the `bash` tool: `{"command", "timeout"}` gives `{"output",
    "exit_code", "timed_out"}` like the tool server's (exit_code None on a timeout)."""

    def __init__(self, kept: dict[str, Any], *, max_output: int = EXEC_OUTPUT_LIMIT) -> None:
        self.kept = kept
        self.max_output = max_output

    def halt(self) -> None:
        """Kill everything the agent had running in the box (idempotent)."""
        halt(self.kept)

    def run(
        self, argv: list[str], *, timeout: float = DEFAULT_TIMEOUT, input: str | None = None
    ) -> ExecResult:
        """`argv` as a fresh process over the box's files (the box is halted first)."""
        return exec_fresh(self.kept, argv, timeout=timeout, input=input,
                          max_output=self.max_output)  # fmt: skip

    def bash(self, command: str, *, timeout: float = DEFAULT_TIMEOUT) -> ExecResult:
        """`command` in a bash that reads no startup file and inherits nothing."""
        return self.run(["bash", "--noprofile", "--norc", "-c", command], timeout=timeout)

    def call(self, tool: str, **args: Any) -> dict[str, Any]:
        if tool != "bash":
            raise ValueError(f"grading runs bash commands only, not the {tool!r} tool")
        command = args.get("command")
        if not isinstance(command, str):
            raise ValueError("bash needs a command")
        timeout = args.get("timeout")
        result = self.bash(command, timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        return {
            "output": result.stdout + result.stderr,
            "exit_code": None if result.timed_out else result.returncode,
            "timed_out": result.timed_out,
            "killed_by": result.killed_by,
        }
