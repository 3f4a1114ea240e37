"""Finding the program in a reply, and comparing what it printed or returned with the expected.

The program is the last ```python block of a turn's visible text (an untagged block counts
when the turn has no tagged one). An output matches the expected output token by token:
whitespace of any kind (spaces, tabs, line breaks) only separates tokens; two tokens match
when they are equal strings, equal integers ("007" and "7"), or numbers at least one of
which is not an integer that differ by at most 1e-6 absolutely or relatively; case matters.
A return value, turned into JSON (tuples become lists, sets sorted lists), matches when it
equals the expected value under the same number rule (booleans only equal booleans).
"""

from __future__ import annotations

import math
import re
from typing import Any

from workers.handlers.base import visible_text

FLOAT_TOLERANCE = 1e-6
"""Largest absolute or relative difference of two matching non-integer numbers."""

# A fenced block: its language tag and its body, up to the next fence.
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})


def extract_code(text: str) -> str | None:
    """The program in an assistant turn: the last ```python block of its visible text, or,
    when there is none, the last untagged block; None when neither holds any code."""
    tagged: str | None = None
    untagged: str | None = None
    for match in _FENCE.finditer(visible_text(text)):
        tag, body = match.group(1).lower(), match.group(2)
        if not body.strip():
            continue
        if tag in _PYTHON_TAGS:
            tagged = body
        elif not tag:
            untagged = body
    return tagged if tagged is not None else untagged


def last_program(assistant_texts: list[str]) -> tuple[str, int] | None:
    """The program of the last turn that has one, and that turn's index; None if none has."""
    for turn in range(len(assistant_texts) - 1, -1, -1):
        code = extract_code(assistant_texts[turn])
        if code is not None:
            return code, turn
    return None


# ----------------------------------------------------------------------------- comparison

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


def _integer_key(token: str) -> tuple[bool, str]:
    """(negative, digits) of an integer token, so that huge integers compare without int()."""
    negative = token.startswith("-")
    digits = token.lstrip("+-").lstrip("0") or "0"
    return negative and digits != "0", digits


def tokens_match(got: str, expected: str) -> bool:
    """Two output tokens match: equal, equal integers, or numbers within `FLOAT_TOLERANCE`."""
    if got == expected:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(expected):
        return _integer_key(got) == _integer_key(expected)
    # Tokens too large for a float ("1e999") only match when written the same.
    return _numbers_close(float(got), float(expected), infinite_equal=False)


def _numbers_close(got: float, expected: float, *, infinite_equal: bool = True) -> bool:
    if not (math.isfinite(got) and math.isfinite(expected)):
        return infinite_equal and got == expected
    return abs(got - expected) <= FLOAT_TOLERANCE * max(1.0, abs(expected))


def outputs_match(got: str, expected: str) -> bool:
    """A program's output matches the expected output (the token rule in the module docstring)."""
    got_tokens, expected_tokens = got.split(), expected.split()
    return len(got_tokens) == len(expected_tokens) and all(
        tokens_match(g, e) for g, e in zip(got_tokens, expected_tokens, strict=True)
    )


def values_match(got: Any, expected: Any) -> bool:
    """Two JSON values are equal, numbers within `FLOAT_TOLERANCE` (integers exactly)."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return isinstance(got, bool) and isinstance(expected, bool) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        try:
            return _numbers_close(float(got), float(expected))
        except OverflowError:  # an integer beyond any float
            return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(
            values_match(g, e) for g, e in zip(got, expected, strict=True)
        )
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and bool(got == expected)
