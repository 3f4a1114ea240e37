"""The `math` handler: competition and grade-school math graded with math-verify.

Accepted task shapes (besides `data_source` and `instance_id`):

- GSM8K: `question`, `answer` whose last line is `#### 42`;
- MATH: `problem`, `solution` with the final answer in `\\boxed{...}` (or an `answer` field);
- DeepScaleR and similar: `problem`, `answer`, optional `solution`;
- plain: `prompt` and `answer`.

The gold answer is `answer` when present (its `#### x` or last `\\boxed{}` if it has one,
else the whole field), otherwise the last `\\boxed{}` of `solution`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from core.settings import Settings
from workers.handlers.base import (
    Grade,
    Handler,
    StepResult,
    TaskValidationError,
    ToolSession,
    find_boxed,
    first_text,
    visible_text,
)

SYSTEM_PROMPT = (
    "Solve the following math problem. Reason step by step, "
    "and put your final answer within \\boxed{}."
)
REMINDER = "Please give your final answer within \\boxed{}."

PROBLEM_FIELDS = ("problem", "question", "prompt")
"""Where the problem text may be, in order of preference."""

AnswerForm = Literal["boxed", "hashes", "phrase"]

# Longer "final answers" are reasoning that happens to follow a marker, not answers.
_MAX_ANSWER_CHARS = 1000


@dataclass(frozen=True)
class FinalAnswer:
    """A final answer found in a text: its text, the form it was given in, and where."""

    text: str
    form: AnswerForm
    start: int


_HASHES = re.compile(r"^[ \t]*####[ \t]*(\S[^\n]*)", re.MULTILINE)
# "The (final) answer is x", "Final answer: x", and a line starting "Answer: x"; a mere
# "the answer:" inside a sentence ("to find the answer: first ...") is no answer.
_PHRASE = re.compile(
    r"(?:\b(?i:(?:final\s+)?answer\s+is)\b\s*:?"
    r"|\b(?i:final\s+answer)\**(?:\s*[:\uff1a]|\s+is\b\s*:?)"
    r"|^[ \t>#*_-]*(?i:answer)\**\s*[:\uff1a])"
    r"[ \t*]*([^\n]+)",
    re.MULTILINE,
)
_SENTENCE_END = re.compile(r"[.!;](?:\s|$)|,?\s+(?:so|which|because|since|but|as)\b")


def _clean(answer: str) -> str:
    """Strip the decoration around an answer: markdown bold, math delimiters, final period."""
    answer = answer.strip()
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().rstrip(".!").strip()
        for left, right in (("**", "**"), ("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if answer.startswith(left) and answer.endswith(right) and len(answer) > 2 * len(left):
                answer = answer[len(left) : -len(right)]
    return answer


def _phrase_answer(rest: str) -> str | None:
    """The answer in the text after "the answer is": up to the end of its sentence.

    Only text that looks mathematical (a digit or a LaTeX command) counts, so that
    "the answer is not obvious yet" is not taken for an answer.
    """
    end = _SENTENCE_END.search(rest)
    candidate = _clean(rest[: end.start()] if end else rest)
    if not re.search(r"[\d\\]", candidate):
        return None
    return candidate


def find_final_answer(text: str) -> FinalAnswer | None:
    """The last final answer in an assistant turn's visible text, or None.

    Recognised forms: `\\boxed{x}`, a line `#### x`, and "The (final) answer is x" /
    "Final answer: x" when x looks mathematical. The one that starts last wins.
    """
    text = visible_text(text)
    candidates: list[FinalAnswer] = [
        FinalAnswer(box.content, "boxed", box.start) for box in find_boxed(text) if box.content
    ]
    for match in _HASHES.finditer(text):
        candidates.append(FinalAnswer(_clean(match.group(1)), "hashes", match.start()))
    for match in _PHRASE.finditer(text):
        phrase = _phrase_answer(match.group(1))
        if phrase is not None:
            candidates.append(FinalAnswer(phrase, "phrase", match.start()))
    candidates = [c for c in candidates if c.text and len(c.text) <= _MAX_ANSWER_CHARS]
    return max(candidates, key=lambda c: c.start, default=None)


def gold_answer(task: dict[str, Any]) -> str:
    """The task's gold answer as text (see the module docstring for where it comes from).

    Raises `TaskValidationError` naming `answer` or `solution` when there is none.
    """
    answer = task.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise TaskValidationError("answer", "must be a string or a number")
        text = str(answer)
        hashes = list(_HASHES.finditer(text))
        boxes = find_boxed(text)
        if hashes:
            text = _clean(hashes[-1].group(1))
        elif boxes:
            text = boxes[-1].content
        if not text.strip():
            raise TaskValidationError("answer", "must not be blank")
        return _clean(text)
    solution = task.get("solution")
    if solution is None:
        raise TaskValidationError("answer", "is required (or a solution with \\boxed{answer})")
    if not isinstance(solution, str):
        raise TaskValidationError("solution", "must be a string")
    boxes = [box for box in find_boxed(solution) if box.content]
    if not boxes:
        raise TaskValidationError(
            "solution", "has no \\boxed{} final answer and there is no answer"
        )
    return boxes[-1].content


def problem_text(task: dict[str, Any]) -> str:
    """The problem statement: `problem`, `question` or `prompt`, the first one present."""
    return first_text(task, PROBLEM_FIELDS)


# ----------------------------------------------------------------------------- checking

# Words math-verify would otherwise read as products of variables ("18 dollars" → 18·d·o·...).
_WORD = re.compile(
    r"(?<![\\A-Za-z{])(?:[A-Za-z]{3,}|cm|mm|km|kg|mg|ml|mL|ft|yd|lb|oz|hr|hrs)(?![A-Za-z])"
)
_KEEP_WORDS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "max", "min"})
_TEXT_COMMANDS = re.compile(r"\\(?:text|mathrm|mbox|textbf|operatorname)\b")


def as_latex(answer: str) -> str:
    """An answer as the LaTeX math-verify reads best: boxed, with plain words as `\\text{}`.

    Gold and prediction both go through this, so that units and words are treated alike.
    """
    if not _TEXT_COMMANDS.search(answer):
        answer = _WORD.sub(
            lambda m: m.group() if m.group().lower() in _KEEP_WORDS else f"\\text{{{m.group()}}}",
            answer,
        )
    return f"\\boxed{{{answer}}}"


@dataclass(frozen=True)
class CheckLimits:
    """Seconds math-verify may spend parsing one answer and comparing two."""

    parse_s: int = 5
    verify_s: int = 5

    @property
    def total_s(self) -> float:
        """The most one full check can take: two parses and one comparison, plus slack."""
        return 2 * self.parse_s + self.verify_s + 2.0


def check_answer(gold: str, predicted: str, limits: CheckLimits | None) -> dict[str, Any]:
    """Compare two answers with math-verify; returns {"correct", "reason"} and the parses.

    With `limits`, math-verify bounds each step itself with `signal.alarm`, which works only
    on the main thread; with None nothing bounds the time and the caller must.
    `reason` is one of "correct", "incorrect", "unparsable_gold", "unparsable_answer",
    "timeout".
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException

    if limits is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math-verify time limits need the main thread; pass limits=None")
    verify_timeout = limits.verify_s if limits else None
    try:
        gold_parsed = _parse(gold, limits.parse_s if limits else None)
        if not gold_parsed:
            return {"correct": False, "reason": "unparsable_gold"}
        pred_parsed = _parse(predicted, limits.parse_s if limits else None)
        if not pred_parsed:
            return {"correct": False, "reason": "unparsable_answer"}
        try:
            correct = verify(
                gold_parsed, pred_parsed, timeout_seconds=verify_timeout, raise_on_error=True
            )
        except Exception:
            # One failing pair of interpretations must not hide another that matches.
            correct = verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout)
    except TimeoutException:
        return {"correct": False, "reason": "timeout"}
    return {
        "correct": bool(correct),
        "reason": "correct" if correct else "incorrect",
        "gold_parsed": _summary(gold_parsed[0]),
        "answer_parsed": _summary(pred_parsed[0]),
    }


def _summary(value: Any, limit: int = 200) -> str:
    """A short printable form of a parsed value (huge integers refuse `str`)."""
    try:
        text = str(value)
    except ValueError:
        return "<too large to print>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _parse(answer: str, timeout_s: int | None) -> list[Any]:
    """math-verify's parse of an answer; empty when it cannot be read. Timeouts propagate."""
    from math_verify import parse

    try:
        parsed: list[Any] = parse(as_latex(answer), parsing_timeout=timeout_s, raise_on_error=True)
    except Exception:
        return []
    return parsed


def serve_checks() -> None:
    """Child process loop: answer JSON lines `[gold, predicted]` on stdin with `check_answer`.

    The limits come as JSON in `sys.argv[1]`; a line "ready" goes out once math-verify is
    imported. Ends at end of input, that is when the parent goes away.
    """
    import math_verify  # noqa: F401  (imported before "ready", so requests are fast)

    limits = CheckLimits(**json.loads(sys.argv[1]))
    print("ready", flush=True)
    for line in sys.stdin:
        gold, predicted = json.loads(line)
        print(json.dumps(check_answer(gold, predicted, limits)), flush=True)


class IsolatedChecker:
    """Runs `check_answer` in child processes, for callers off the main thread.

    Each child is a fresh interpreter running math-verify on its main thread, where its
    alarms work; a child that overruns `deadline_s` anyway (stuck in C code) is killed and
    replaced. A child serves one caller at a time; idle children are kept for reuse, up to
    `max_idle`.
    """

    def __init__(
        self,
        limits: CheckLimits,
        deadline_s: float | None = None,
        max_idle: int = 4,
        startup_s: float = 60.0,
    ) -> None:
        self.limits = limits
        self.deadline_s = limits.total_s if deadline_s is None else deadline_s
        self.max_idle = max_idle
        self.startup_s = startup_s
        self._idle: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def check(self, gold: str, predicted: str) -> dict[str, Any]:
        """`check_answer(gold, predicted)` within the deadline, or a "timeout" outcome.

        Raises RuntimeError when no child can be started.
        """
        child = self._take()
        try:
            try:
                _send(child, [gold, predicted])
            except BrokenPipeError:
                # An idle child that died meanwhile; not this answer's doing.
                _stop(child)
                child = self._take()
                _send(child, [gold, predicted])
            line = _read_line(child, self.deadline_s)
            if line is None:
                _stop(child)
                return {"correct": False, "reason": "timeout"}
            outcome: dict[str, Any] = json.loads(line)
        except (OSError, ValueError):
            # The child died on this input (e.g. sympy exhausted its memory): the answer's fault.
            _stop(child)
            return {"correct": False, "reason": "checker_crashed"}
        except BaseException:
            _stop(child)
            raise
        self._give_back(child)
        return outcome

    def close(self) -> None:
        """Stop the idle children."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            _stop(child)

    def _take(self) -> subprocess.Popen[str]:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.poll() is None:
                    return child
                _stop(child)
        # The child must import this package wherever the parent found it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, json.dumps(dataclasses.asdict(self.limits))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if _read_line(child, self.startup_s) != "ready":
            _stop(child)
            raise RuntimeError(f"math-verify child did not start within {self.startup_s} s")
        return child

    def _give_back(self, child: subprocess.Popen[str]) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(child)
                return
        _stop(child)


_CHILD_MAIN = "from workers.handlers.math import serve_checks; serve_checks()"


def _send(child: subprocess.Popen[str], request: list[str]) -> None:
    assert child.stdin is not None
    child.stdin.write(json.dumps(request) + "\n")
    child.stdin.flush()


def _read_line(child: subprocess.Popen[str], timeout_s: float) -> str | None:
    """The child's next output line without its newline; None if none came in time.

    Raises OSError when the child has exited.
    """
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    if not ready:
        return None
    line = child.stdout.readline()
    if not line:
        raise OSError("math-verify child exited")
    return line.rstrip("\n")


def _stop(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(timeout=5)
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            stream.close()


# ----------------------------------------------------------------------------- handler


class MathHandler(Handler):
    """Math problems answered in `\\boxed{}` and graded with math-verify (reward 1.0 or 0.0)."""

    name: ClassVar[str] = "math"

    def __init__(
        self, limits: CheckLimits | None = None, *, settings: Settings | None = None
    ) -> None:
        super().__init__(settings=settings)
        self.limits = limits or CheckLimits()
        self._isolated: IsolatedChecker | None = None
        self._isolated_lock = threading.Lock()

    def validate(self, task: dict[str, Any]) -> None:
        """Require a problem text and a gold answer (see the module docstring)."""
        problem_text(task)
        gold_answer(task)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A system prompt asking for reasoning and a boxed answer, then the problem."""
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem_text(task)},
        ]

    def warm_up(self) -> None:
        """Import math-verify (and sympy behind it) and run one check, so the first grade of
        every pool process is as fast as the rest."""
        check_answer("1/2", "0.5", None)

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        """Done once the turn states a final answer; otherwise ask for one in `\\boxed{}`."""
        if find_final_answer(assistant_text) is not None:
            return StepResult(done=True, messages=[], stop_reason="answer")
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
        """Reward 1.0 when the last final answer of the episode equals the gold answer.

        Works on any thread: on the main thread math-verify bounds its own time; off it the
        check runs in a child process with a deadline (`CheckLimits.total_s`).
        """
        gold = gold_answer(task)
        details: dict[str, Any] = {"method": "math_verify", "gold": gold, "extracted": None}
        for turn in range(len(assistant_texts) - 1, -1, -1):
            found = find_final_answer(assistant_texts[turn])
            if found is not None:
                break
        else:
            details["reason"] = "no_answer"
            return Grade(reward=0.0, details=details)
        details.update(extracted=found.text, answer_form=found.form, answer_turn=turn)
        outcome = self._check(gold, found.text)
        details.update({k: v for k, v in outcome.items() if k != "correct"})
        return Grade(reward=1.0 if outcome["correct"] else 0.0, details=details)

    def _check(self, gold: str, predicted: str) -> dict[str, Any]:
        if threading.current_thread() is threading.main_thread():
            return check_answer(gold, predicted, self.limits)
        with self._isolated_lock:
            if self._isolated is None:
                self._isolated = IsolatedChecker(self.limits)
            isolated = self._isolated
        return isolated.check(gold, predicted)
