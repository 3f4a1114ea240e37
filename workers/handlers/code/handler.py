"""The `code` handler: program synthesis graded by hidden tests run in a sandbox.

The model answers with a Python 3 program in a fenced code block; the last ```python block
of the episode is graded (an untagged block counts when a turn has no tagged one). The task
shapes accepted are in `records`, how outputs are compared in `matching`, how the tests are
run and judged in `grading`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from core.settings import Settings
from workers.handlers.base import Grade, Handler, StepResult, ToolSession
from workers.handlers.code.grading import run_tests
from workers.handlers.code.matching import extract_code, last_program
from workers.handlers.code.records import CallTest, read_task
from workers.handlers.gradingbox import GradingPlace, grading_place

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the programming problem. Think it through, "
    "then give your complete solution as one Python 3 program in a single ```python code "
    "block; the last such block of your reply is what gets tested."
)
STDIO_INSTRUCTION = (
    "Your program reads the input from standard input and writes the answer to standard output."
)
REMINDER = "Please give your complete solution as one Python 3 program in a ```python code block."


class CodeHandler(Handler):
    """Python programs graded by hidden tests in a sandbox: reward 1.0 when all pass, or the
    passing fraction when the task asks for it."""

    name: ClassVar[str] = "code"

    def __init__(
        self,
        *,
        budget_seconds: float = 300.0,
        stop_at_first_failure: bool = True,
        backend: str | None = None,
        state_root: Path | None = None,
        settings: Settings | None = None,
    ) -> None:
        """`budget_seconds` bounds one episode's grading (also kept under EVAL's soft time
        limit); with `stop_at_first_failure`, an "all" task stops at its first test that fails
        to exit cleanly. `backend` and `state_root` (where grading boxes are made) default to
        the settings' sandbox backend and `<sandbox_dir>/.grading`."""
        super().__init__(settings=settings)
        self.budget_seconds = budget_seconds
        self.stop_at_first_failure = stop_at_first_failure
        self.backend = backend
        self.state_root = state_root

    def validate(self, task: dict[str, Any]) -> None:
        """Require a problem statement and at least one well-formed test (any accepted shape)."""
        read_task(task)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A system prompt asking for one program in a ```python block, then the problem with
        how the program is run: on stdin/stdout, or by calling the named function."""
        spec = read_task(task)
        parts = [spec.problem.strip()]
        calls = sorted({t.fn_name for t in spec.tests if isinstance(t, CallTest)})
        if calls:
            names = ", ".join(f"`{name}`" for name in calls)
            parts.append(
                f"Your program defines the function {names} (at top level, or as a method of a "
                "class `Solution`); the tests call it and check what it returns."
            )
        else:
            parts.append(STDIO_INSTRUCTION)
        if spec.starter_code.strip():
            parts.append(f"Start from this code:\n```python\n{spec.starter_code.rstrip()}\n```")
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        """Done once the turn holds a program; otherwise one reminder, then the episode ends."""
        if extract_code(assistant_text) is not None:
            return StepResult(done=True, stop_reason="answer")
        if turn == 0:
            return StepResult(done=False, messages=[{"role": "user", "content": REMINDER}])
        return StepResult(done=True, stop_reason="no_code")

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        """Run the episode's last program on the task's tests in a fresh sandbox, labelled
        with `job_id`.

        Reward 1.0 when every test passes (0.0 otherwise), or the passing fraction with
        `reward: "fraction"`. Details: `passed`, `total`, per-test verdicts in `tests`, and a
        `reason` ("no code found" when no turn holds a program).
        """
        spec = read_task(task)
        details: dict[str, Any] = {
            "method": "tests",
            "reward_mode": spec.reward,
            "passed": 0,
            "total": len(spec.tests),
            "time_limit": spec.time_limit,
            "memory_limit_mb": spec.memory_mb,
        }
        found = last_program(assistant_texts)
        if found is None:
            details.update(reason="no code found", tests=[])
            return Grade(reward=0.0, details=details)
        program, turn = found
        started = time.monotonic()
        results = run_tests(
            program,
            spec,
            self._place(),
            job_id=job_id,
            budget_seconds=self._budget(),
            stop_at_first_failure=self.stop_at_first_failure and spec.reward == "all",
        )
        passed = sum(r.verdict == "pass" for r in results)
        total = len(results)
        all_passed = 1.0 if passed == total else 0.0
        reward = passed / total if spec.reward == "fraction" else all_passed
        failed = [r for r in results if r.verdict != "pass"]
        details.update(
            passed=passed,
            code_turn=turn,
            grading_seconds=round(time.monotonic() - started, 3),
            reason="all tests passed"
            if not failed
            else f"test {failed[0].index}: {failed[0].verdict}",
            tests=[r.as_dict() for r in results],
        )
        return Grade(reward=reward, details=details)

    def _place(self) -> GradingPlace:
        return grading_place(self.settings, backend=self.backend, state_root=self.state_root)

    def _budget(self) -> float:
        # Past EVAL's soft limit the job fails; a partial grade within it is worth more.
        return max(1.0, min(self.budget_seconds, self.settings.eval_soft_time_limit * 0.8))
