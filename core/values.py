"""Bounds and value types every wire model shares (re-exported by `core.schemas`)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator

MAX_SEED = 2**63 - 1
"""Largest seed of any sample: backends take signed 64-bit seeds (vLLM refuses larger ones)."""
MAX_TOKENS = 1 << 20
"""Schema bound of `max_tokens` and `max_total_tokens`; the backends' context length is
usually a tighter one."""
MAX_POLICY_VERSION = 2**63 - 1
"""Largest policy version: a signed 64-bit integer, as trainers count steps."""
MAX_STALE_RERUNS = 3
"""Times a stale job's episode is started again (`AgentParams.on_stale`) before it is dropped."""
MAX_TASK_DEPTH = 64
"""Deepest nesting of lists and objects inside a task."""
HARNESS_OUTPUT_LIMIT = 64 << 10
"""Bytes of a harness's stdout and of its stderr kept in its trajectory (`HarnessRun`)."""


def encodable(value: str) -> str:
    """`value` when it is valid Unicode text; a lone surrogate (JSON `"\\ud800"`) is not, and
    could be neither stored, tokenized nor sent on."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        raise ValueError(
            f"holds a lone surrogate (U+{code:04X} at index {exc.start}): not valid Unicode text"
        ) from None
    return value


Text = Annotated[str, AfterValidator(encodable)]
"""A string that encodes as UTF-8."""


def json_problem(
    value: Any, max_depth: int = MAX_TASK_DEPTH, *, allow_nonfinite: bool = False
) -> tuple[list[str | int], str] | None:
    """The first place in a JSON value that strict JSON cannot carry or that could not be
    passed on as text: a lone surrogate in a string or a key, a NaN or infinite number
    (unless `allow_nonfinite`), or nesting deeper than `max_depth`. Returns its path and what
    is wrong, or None."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                encodable(item)
            except ValueError as exc:
                return path, str(exc)
        elif isinstance(item, float):
            if not (allow_nonfinite or math.isfinite(item)):
                return path, f"must be a finite number, not {item}"
        elif isinstance(item, dict | list):
            if len(path) >= max_depth:
                return path, f"nests lists and objects deeper than {max_depth} levels"
            if isinstance(item, list):
                stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(item))))
                continue
            for key, child in reversed(list(item.items())):
                try:
                    encodable(key)
                except ValueError as exc:
                    safe = key.encode("utf-8", "backslashreplace").decode("utf-8")
                    return [*path, safe], f"the key {exc}"
                stack.append(([*path, key], child))
    return None
