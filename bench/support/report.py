"""The report conventions every benchmark keeps.

A benchmark prints a readable table and, as its last stdout line, one JSON object with its
figures and conditions (`print_json`). A baseline that fails — a timeout under load, a tool
that will not start — does not fail the run: it is measured through `run_baseline`, its
entry in the JSON becomes `{"failed": "<type>: <message>"}` (`failure`), ratios against it
are null, and our own figures are still reported, with exit status 0.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

FAILED = "failed"


def failure(exc: BaseException) -> dict[str, str]:
    """A failed baseline's entry: `{"failed": "<type>: <message>"}`."""
    message = str(exc).strip().splitlines()
    text = type(exc).__name__ + (f": {message[0]}" if message else "")
    return {FAILED: text[:500]}


def has_failed(entry: object) -> bool:
    """Whether `entry` is a failed baseline's entry."""
    return isinstance(entry, dict) and FAILED in entry


def failed_baseline(name: str, exc: BaseException) -> dict[str, str]:
    """The entry of baseline `name`, which raised `exc`; the traceback goes to stderr."""
    print(f"baseline {name} failed:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return failure(exc)


def run_baseline(name: str, measure: Callable[[], T]) -> T | dict[str, str]:
    """What `measure()` returns, or, when it raises, the failure entry (`failed_baseline`).
    Only for baselines: a failure of our own measurement should fail the run."""
    try:
        return measure()
    except Exception as exc:
        return failed_baseline(name, exc)


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float (nested in dicts, lists, tuples) as None,
    since JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def json_line(results: dict[str, Any]) -> str:
    """`results` as one line of strict JSON."""
    return json.dumps(finite(results), allow_nan=False)


def print_json(results: dict[str, Any]) -> None:
    """Print `results` as the run's last stdout line."""
    print(json_line(results), flush=True)
