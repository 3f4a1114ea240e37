"""Tool calls and reasoning read out of generated text, per model family.

The engine returns ids and their text; a harness wants OpenAI or Anthropic tool calls. A
parser splits the text into reasoning, content and calls. A block it cannot read stays in
the content as the model wrote it and is counted (`Parsed.errors`): a policy's malformed call
is its own mistake for the harness to see, never an error of the endpoint.

`hermes` (also `qwen3`, `qwen2.5`): `<think>...</think>` reasoning first, then
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen2.5/3 and Hermes
chat templates render them. More families register in `PARSERS`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from workers.harness.wire import ToolCallOut


@dataclass
class Parsed:
    content: str
    reasoning: str | None = None
    calls: list[ToolCallOut] = field(default_factory=list)
    errors: int = 0
    """Blocks that looked like tool calls but could not be read (left in `content`)."""


class ToolParser(Protocol):
    def parse(self, text: str) -> Parsed: ...


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser:
    """`<think>` reasoning and `<tool_call>` JSON blocks (Qwen2.5, Qwen3, Hermes)."""

    def parse(self, text: str) -> Parsed:
        reasoning = None
        think = _THINK.match(text)
        if think is not None:
            reasoning = think.group(1).strip()
            text = text[think.end() :]
        parsed = Parsed(content="", reasoning=reasoning)
        kept: list[str] = []
        at = 0
        for match in _BLOCK.finditer(text):
            call = self._read(match.group(0), match.group(1))
            kept.append(text[at : match.start()])
            if call is None:
                parsed.errors += 1
                kept.append(match.group(0))
            else:
                parsed.calls.append(call)
            at = match.end()
        kept.append(text[at:])
        parsed.content = "".join(kept).strip() if parsed.calls else "".join(kept)
        return parsed

    @staticmethod
    def _read(block: str, body: str) -> ToolCallOut | None:
        if not block.endswith("</tool_call>"):
            return None
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCallOut(id=call_id(), name=obj["name"], arguments=json.dumps(arguments))


PARSERS: dict[str, ToolParser] = {
    "hermes": HermesParser(),
    "qwen3": HermesParser(),
    "qwen2.5": HermesParser(),
}


def get_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}") from None
