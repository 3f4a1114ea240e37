"""A chat template over characters, for tests of the turn bookkeeping without a tokenizer."""

from __future__ import annotations

import json
from typing import Any

from routing.protocol import Completion

HEADERS = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END = 9
TOOLS_MARK = 7


def chars(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def _message_text(message: dict[str, Any]) -> str:
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        args = fn["arguments"]
        args = json.loads(args) if isinstance(args, str) else args
        text += f"<call {fn['name']} {json.dumps(args, sort_keys=True)}>"
    return text


class ToyTemplater:
    """A chat template over characters: a header id per role, the text's characters, an end
    id; the generation prompt is the assistant header; tools are listed first."""

    def __init__(self) -> None:
        self.full_renders = 0

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [HEADERS[m["role"]], *chars(_message_text(m)), END]
        return ids

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        self.full_renders += 1
        head = [TOOLS_MARK, *chars(",".join(t["function"]["name"] for t in tools))] if tools else []
        return head + self._render(messages) + [HEADERS["assistant"]]

    async def detokenize(self, ids: list[int]) -> str:
        return await detokenize(ids)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        closing = [] if last_output_ids[-1:] == [END] else [END]
        return closing + self._render(messages) + [HEADERS["assistant"]]


def answer(text: str, version: int = 3) -> Completion:
    ids = [*chars(text), END]
    return Completion(
        output_ids=ids,
        logprobs=[-0.5] * len(ids),
        text=text,
        finish_reason="stop",
        stop_reason=None,
        prompt_tokens=0,
        backend_id="b",
        policy_version=version,
    )


async def detokenize(ids: list[int]) -> str:
    """The toy's text of `ids`: characters, and markers for the template's own ids."""
    return "".join(chr(i - 100) if i >= 100 else f"<{i}>" for i in ids)
