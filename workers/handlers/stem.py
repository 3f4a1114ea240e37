"""The `stem` handler: multiple-choice and short-answer science questions.

Accepted task shapes (besides `data_source` and `instance_id`):

- multiple choice: `question`, `choices` as a list (lettered A, B, ... in order) or as a
  dict {"A": ..., "B": ...}, and `answer` as a letter ("B") or a 0-based index (1);
- short answer: `question` and `answer` as a string (or number) or a list of accepted ones.

The model is asked to end with "Answer: X". Answers are read from "Answer: X",
"The answer is X", `\\boxed{X}` and, for multiple choice, a last line holding only the
letter ("(B)"); the one that starts last wins. Short answers are compared after
normalisation (case, whitespace, punctuation, articles, number formatting).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar, Literal

from workers.handlers.base import (
    Grade,
    Handler,
    StepResult,
    TaskValidationError,
    ToolSession,
    find_boxed,
    required_text,
    visible_text,
)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

MULTIPLE_CHOICE_PROMPT = (
    "Answer the following multiple-choice question. Think it through step by step, then end "
    'your reply with a line of the form "Answer: X", where X is the letter of the correct choice.'
)
SHORT_ANSWER_PROMPT = (
    "Answer the following question. Think it through step by step, then end your reply with "
    'a line of the form "Answer: <answer>", giving the answer as briefly as possible.'
)

AnswerForm = Literal["answer_line", "boxed", "bare_letter"]


@dataclass(frozen=True)
class MultipleChoice:
    """A validated multiple-choice task."""

    question: str
    labels: list[str]
    texts: list[str]
    answer: str
    """The correct label."""


@dataclass(frozen=True)
class ShortAnswer:
    """A validated short-answer task."""

    question: str
    accepted: list[str]
    """Every accepted answer, as given."""


@dataclass(frozen=True)
class FoundAnswer:
    """An answer found in a text: its text (a label for multiple choice), form and start."""

    text: str
    form: AnswerForm
    start: int


# ----------------------------------------------------------------------------- task shapes


def _choice_text(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TaskValidationError(where, "must be a string")
    text = str(value)
    if not text.strip():
        raise TaskValidationError(where, "must not be blank")
    return text


def _read_choices(choices: Any) -> tuple[list[str], list[str]]:
    if isinstance(choices, list):
        if len(choices) > len(LETTERS):
            raise TaskValidationError("choices", f"at most {len(LETTERS)} choices")
        texts = [_choice_text(value, f"choices.{i}") for i, value in enumerate(choices)]
        labels = list(LETTERS[: len(texts)])
    elif isinstance(choices, dict):
        labels, texts = [], []
        for key, value in choices.items():
            label = str(key).strip().upper()
            if len(label) != 1 or label not in LETTERS:
                raise TaskValidationError("choices", f"keys must be single letters, not {key!r}")
            if label in labels:
                raise TaskValidationError("choices", f"letter {label} appears twice")
            labels.append(label)
            texts.append(_choice_text(value, f"choices.{key}"))
    else:
        raise TaskValidationError("choices", "must be a list or a dict of letter to text")
    if len(texts) < 2:
        raise TaskValidationError("choices", "needs at least two choices")
    return labels, texts


def _read_choice_answer(answer: Any, labels: list[str], texts: list[str]) -> str:
    if answer is None:
        raise TaskValidationError("answer", "is required")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(labels):
            raise TaskValidationError(
                "answer", f"index {answer} is out of range for {len(labels)} choices"
            )
        return labels[answer]
    if not isinstance(answer, str):
        raise TaskValidationError("answer", "must be a choice letter or a 0-based index")
    letter = answer.strip().strip("().").strip().upper()
    if letter in labels:
        return letter
    # Some datasets give the text of the correct choice instead of its letter.
    matching = [label for label, text in zip(labels, texts, strict=True) if same_text(text, answer)]
    if len(matching) == 1:
        return matching[0]
    raise TaskValidationError(
        "answer", f"{answer!r} is not one of the choice letters {', '.join(labels)}"
    )


def _read_accepted(answer: Any) -> list[str]:
    if answer is None:
        raise TaskValidationError("answer", "is required")
    if isinstance(answer, list):
        if not answer:
            raise TaskValidationError("answer", "must list at least one accepted answer")
        return [_choice_text(value, f"answer.{i}") for i, value in enumerate(answer)]
    return [_choice_text(answer, "answer")]


def read_task(task: dict[str, Any]) -> MultipleChoice | ShortAnswer:
    """The task as a `MultipleChoice` (when it has `choices`) or a `ShortAnswer`.

    Raises `TaskValidationError` naming the field that is missing or malformed.
    """
    question = required_text(task, "question")
    if task.get("choices") is not None:
        labels, texts = _read_choices(task["choices"])
        answer = _read_choice_answer(task.get("answer"), labels, texts)
        return MultipleChoice(question, labels, texts, answer)
    return ShortAnswer(question, _read_accepted(task.get("answer")))


# ----------------------------------------------------------------------------- answers

_ARTICLES = frozenset({"a", "an", "the"})
_TOKEN = re.compile(r"-?\d+(?:\.\d+)?|[^\W_]+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    """A short answer in canonical form: lower case, no punctuation, articles or LaTeX
    wrappers, single spaces, numbers without thousands separators or trailing zeros
    ("3.0" → "3", "1,000" → "1000")."""
    text = _TEXT_COMMAND.sub(r"\1", text.lower())
    text = _THOUSANDS.sub("", text)
    tokens = []
    for token in _TOKEN.findall(text):
        if token in _ARTICLES:
            continue
        if token[-1].isdigit() and (token[0].isdigit() or token[0] == "-"):
            token = _canonical_number(token)
        tokens.append(token)
    return " ".join(tokens)


def _canonical_number(token: str) -> str:
    try:
        value = Decimal(token)
    except InvalidOperation:
        return token
    text = format(value.normalize(), "f")
    return "0" if text == "-0" else text


def same_text(a: str, b: str) -> bool:
    """Whether two short answers are equal after `normalize_answer` (and not empty)."""
    normalized = normalize_answer(a)
    return bool(normalized) and normalized == normalize_answer(b)


# "The (correct) answer is X", "the correct option is X", "Final answer: X", and a line
# starting "Answer: X"; a mere "the answer:" inside a sentence is no answer.
_MARKER = re.compile(
    r"(?:\b(?i:(?:(?:final|correct|right)\s+)?answer\s+is)\b\s*:?"
    r"|\b(?i:(?:correct|right|best)\s+(?:option|choice)\s+is)\b\s*:?"
    r"|\b(?i:final\s+answer)\**\s*[:\uff1a]"
    r"|^[ \t>#*_-]*(?i:answer)\**\s*[:\uff1a])"
    r"[ \t*]*([^\n]*)",
    re.MULTILINE,
)
_SENTENCE_END = re.compile(r"[.!?;](?:\s|$)")
_BARE_LETTER = re.compile(r"^[\s*(\[]*([A-Za-z])[\s*)\].:]*$")


def _strip_decoration(text: str) -> str:
    """Drop markdown bold, math delimiters and a final period around an answer."""
    text = text.strip().strip("*").strip()
    text = _TEXT_COMMAND.sub(r"\1", text)
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$").strip()
    return text.rstrip(".").strip().strip("*").strip()


def _letter_in(text: str, task: MultipleChoice) -> str | None:
    """The choice `text` names: a letter ("B", "(B)", "option B") or a choice's exact text."""
    match = re.match(
        rf"(?:(?i:option|choice)\s*)?[(\[]?\s*([{''.join(task.labels)}])\s*[)\]]?(?![A-Za-z0-9])",
        text,
    )
    if match:
        return match.group(1)
    core = _strip_decoration(text).strip("()[]").strip()
    if len(core) == 1 and core.upper() in task.labels:
        return core.upper()
    matching = [
        label
        for label, choice in zip(task.labels, task.texts, strict=True)
        if same_text(choice, core)
    ]
    return matching[0] if len(matching) == 1 else None


def find_choice(text: str, task: MultipleChoice) -> FoundAnswer | None:
    """The last choice named in an assistant turn's visible text, or None."""
    text = visible_text(text)
    found: list[FoundAnswer] = []
    for match in _MARKER.finditer(text):
        letter = _letter_in(match.group(1), task)
        if letter is not None:
            found.append(FoundAnswer(letter, "answer_line", match.start()))
    for box in find_boxed(text):
        letter = _letter_in(box.content, task)
        if letter is not None:
            found.append(FoundAnswer(letter, "boxed", box.start))
    lines = [(m.start(), m.group()) for m in re.finditer(r"[^\n]*\S[^\n]*", text)]
    if lines:
        start, last_line = lines[-1]
        bare = _BARE_LETTER.match(last_line)
        if bare and bare.group(1).upper() in task.labels:
            found.append(FoundAnswer(bare.group(1).upper(), "bare_letter", start))
    return max(found, key=lambda f: f.start, default=None)


def find_short_answer(text: str) -> FoundAnswer | None:
    """The last short answer stated in an assistant turn's visible text, or None."""
    text = visible_text(text)
    found: list[FoundAnswer] = []
    for match in _MARKER.finditer(text):
        rest = match.group(1)
        # "The answer is X. Because ..." ends at the sentence; an "Answer:" line is all answer.
        if re.search(r"\bis\b", match.group()[: match.start(1) - match.start()]):
            end = _SENTENCE_END.search(rest)
            rest = rest[: end.start()] if end else rest
        answer = _strip_decoration(rest)
        if answer:
            found.append(FoundAnswer(answer, "answer_line", match.start()))
    for box in find_boxed(text):
        answer = _strip_decoration(box.content)
        if answer:
            found.append(FoundAnswer(answer, "boxed", box.start))
    return max(found, key=lambda f: f.start, default=None)


def find_answer(text: str, task: MultipleChoice | ShortAnswer) -> FoundAnswer | None:
    """The last answer of the task's kind in an assistant turn, or None."""
    if isinstance(task, MultipleChoice):
        return find_choice(text, task)
    return find_short_answer(text)


# ----------------------------------------------------------------------------- handler


class StemHandler(Handler):
    """Multiple-choice and short-answer questions answered as "Answer: X" (reward 1.0 or 0.0)."""

    name: ClassVar[str] = "stem"

    def validate(self, task: dict[str, Any]) -> None:
        """Require a question and a well-formed answer (and choices, for multiple choice)."""
        read_task(task)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A system prompt asking for a final "Answer: X" line, then the question (and choices)."""
        parsed = read_task(task)
        if isinstance(parsed, MultipleChoice):
            listing = "\n".join(
                f"{label}. {text}" for label, text in zip(parsed.labels, parsed.texts, strict=True)
            )
            return [
                {"role": "system", "content": MULTIPLE_CHOICE_PROMPT},
                {"role": "user", "content": f"{parsed.question}\n\n{listing}"},
            ]
        return [
            {"role": "system", "content": SHORT_ANSWER_PROMPT},
            {"role": "user", "content": parsed.question},
        ]

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        """Done once the turn states an answer; otherwise remind of the "Answer: X" line."""
        parsed = read_task(task)
        if find_answer(assistant_text, parsed) is not None:
            return StepResult(done=True, messages=[], stop_reason="answer")
        if isinstance(parsed, MultipleChoice):
            reminder = (
                'Please end your reply with a line "Answer: X", '
                f"where X is one of {', '.join(parsed.labels)}."
            )
        else:
            reminder = 'Please end your reply with a line "Answer: <answer>".'
        return StepResult(done=False, messages=[{"role": "user", "content": reminder}])

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        """Reward 1.0 when the episode's last answer is the correct choice / an accepted answer."""
        parsed = read_task(task)
        details: dict[str, Any] = {"method": "exact_match", "extracted": None}
        if isinstance(parsed, MultipleChoice):
            details.update(kind="multiple_choice", gold=parsed.answer)
        else:
            details.update(kind="short_answer", gold=parsed.accepted)
        for turn in range(len(assistant_texts) - 1, -1, -1):
            found = find_answer(assistant_texts[turn], parsed)
            if found is not None:
                break
        else:
            details["reason"] = "no_answer"
            return Grade(reward=0.0, details=details)
        details.update(extracted=found.text, answer_form=found.form, answer_turn=turn)
        if isinstance(parsed, MultipleChoice):
            correct = found.text == parsed.answer
        else:
            details["normalized"] = normalize_answer(found.text)
            correct = any(same_text(found.text, accepted) for accepted in parsed.accepted)
        details["reason"] = "correct" if correct else "incorrect"
        return Grade(reward=1.0 if correct else 0.0, details=details)
