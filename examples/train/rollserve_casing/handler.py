"""`casing`: write N words, all in one letter case — a reward a policy raises by shifting its
output distribution.

A task is `{"data_source": "casing", "words": 5, "case": "lower"}` (`words` 1 to 50, `case`
`lower`, `upper` or `title`; both optional). The episode is one turn. The reward is the share
of words in the answer (runs of letters, control tokens removed) written in the asked case,
over at least `words` words: writing fewer words does not raise it, and nor do more.
"""

from __future__ import annotations

import re
from typing import Any

from workers.handlers.base import Grade, Handler, StepResult, TaskValidationError, visible_text

CASES = {
    "lower": re.compile(r"[a-z]+"),
    "upper": re.compile(r"[A-Z]+"),
    "title": re.compile(r"[A-Z][a-z]*"),
}
WORD = re.compile(r"[A-Za-z]+")
MAX_WORDS = 50


def instruction(words: int, case: str) -> str:
    """The user's message of a task (the trainer's warm start trains on the same prompts)."""
    return f"Write {words} words in {case} case."


def task_words(task: dict[str, Any]) -> int:
    return int(task.get("words", 5))


def task_case(task: dict[str, Any]) -> str:
    return str(task.get("case", "lower"))


def score(text: str, words: int, case: str) -> tuple[float, dict[str, Any]]:
    """The reward of an answer and how it was reached."""
    found = WORD.findall(visible_text(text))
    matching = sum(1 for word in found if CASES[case].fullmatch(word))
    reward = matching / max(words, len(found))
    return reward, {"words": len(found), "matching": matching, "asked": words, "case": case}


class CasingHandler(Handler):
    """One turn; graded on the words' letter case."""

    name = "casing"

    def validate(self, task: dict[str, Any]) -> None:
        words = task.get("words", 5)
        if not isinstance(words, int) or isinstance(words, bool) or not 1 <= words <= MAX_WORDS:
            raise TaskValidationError("words", f"must be an integer from 1 to {MAX_WORDS}")
        case = task.get("case", "lower")
        if case not in CASES:
            raise TaskValidationError("case", f"must be one of {', '.join(CASES)}")
        unknown = set(task) - {"data_source", "words", "case", "instance_id"}
        if unknown:
            raise TaskValidationError(sorted(unknown)[0], "is not a field of a casing task")

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": instruction(task_words(task), task_case(task))}]

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        return StepResult(done=True, stop_reason="answer")

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: Any = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        text = assistant_texts[-1] if assistant_texts else ""
        reward, details = score(text, task_words(task), task_case(task))
        return Grade(reward=reward, details=details)
