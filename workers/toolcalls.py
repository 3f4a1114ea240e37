"""Tool calls in the Qwen3 / Hermes convention: `<tool_call>{"name", "arguments"}</tool_call>`
blocks in the assistant's text, and their results as `tool` messages."""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ParsedCalls:
    """The well-formed calls of one assistant turn, and why the others could not be read."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every `<tool_call>` block of `text`, in order. A block that is not closed, not JSON, or
    lacks a string `name` or an object `arguments` becomes an error message instead of a call."""
    parsed = ParsedCalls()
    for match in _BLOCK.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            parsed.errors.append("a <tool_call> block is not closed with </tool_call>")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            parsed.errors.append(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            parsed.errors.append('the tool call must be an object with a string "name"')
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            parsed.errors.append(f'the "arguments" of {obj["name"]!r} must be a JSON object')
            continue
        parsed.calls.append(ToolCall(obj["name"], arguments))
    return parsed


def format_result(name: str, result: dict[str, Any]) -> str:
    """A tool's result as the text the model reads."""
    if name == "bash":
        text = str(result.get("output", ""))
        if result.get("timed_out"):
            text += "\n[the command timed out and was interrupted]"
        if result.get("reset"):
            text += "\n[the shell had to be restarted: working directory and environment are reset]"
        elif result.get("exit_code") not in (0, None):
            text += f"\n[exit code {result['exit_code']}]"
        return text
    if name == "ipython":
        text = str(result.get("output", ""))
        if result.get("status") == "timeout":
            text += "\n[the cell timed out and was interrupted]"
        if result.get("restarted"):
            text = "[the kernel had died and was restarted]\n" + text
        return text
    if "output" in result:
        return str(result["output"])
    return json.dumps(result)


TIMED_TOOLS = ("bash", "ipython")
"""Tools whose calls run for a `timeout` the service always sets."""


def bounded_arguments(name: str, arguments: dict[str, Any], bound: float) -> dict[str, Any]:
    """The call's arguments with its `timeout` at most `bound` seconds: the model may ask for
    less, never for more (nor for an invalid value, which becomes the bound); a timed tool
    that names none gets the bound."""
    bounded = dict(arguments)
    if name not in TIMED_TOOLS and "timeout" not in bounded:
        return bounded
    asked = bounded.get("timeout")
    valid = (
        isinstance(asked, (int, float))
        and not isinstance(asked, bool)
        and math.isfinite(asked)
        and asked > 0
    )
    bounded["timeout"] = min(float(asked), bound) if valid else bound  # type: ignore[arg-type]
    return bounded
