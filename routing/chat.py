"""Chat templating with token-in/token-out: history is never re-rendered.

The first prompt is rendered by the served model's own chat template. After that the sequence
only grows: the model's output ids are kept as generated, the assistant turn is closed with
the template's own closing ids, and each new message (tool results, user turns) is rendered
on its own and appended, followed by the generation prompt. The result continues exactly as
the template would render `[..., assistant turn, *new messages]`, without ever tokenizing the
history again (a template that rewrites earlier turns, like Qwen3's dropping of old
reasoning, would otherwise fork the trajectory).

Rendering goes through the backend's `/tokenize` with `messages`, so the worker needs no
tokenizer and always uses the served model's template. The pieces needed to cut new
messages out of a render are derived once per tool set from a dummy conversation.

`template_messages` and `template_tool` put chat messages and tool definitions in the shape
vLLM hands them to a chat template, so that a conversation rendered locally (the SGLang
client, whose server cannot render messages) gets the same ids as one rendered by vLLM's
`/tokenize` (and the development server, which uses them too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from routing.protocol import InferenceClient

_DUMMY_TEXT = "."
_DUMMY_USER = {"role": "user", "content": _DUMMY_TEXT}
_DUMMY_ASSISTANT = {"role": "assistant", "content": _DUMMY_TEXT}
_PROBE = [
    {"role": "tool", "content": "probe result"},
    {"role": "user", "content": "probe question"},
]


class TemplateError(Exception):
    """The chat template cannot be extended by appending ids (it breaks the prefix property)."""


@dataclass(frozen=True)
class _Pieces:
    prompt: list[int]
    """[user "."] rendered with the generation prompt."""
    content: list[int]
    """The ids of "." on its own: the dummy assistant's content."""
    closing: list[int]
    """What the template puts after an assistant message's content to end its turn."""


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    end = len(haystack) - len(needle)
    for i in range(start, end + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def _rfind(haystack: list[int], needle: list[int], start: int) -> int:
    for i in range(len(haystack) - len(needle), start - 1, -1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, separators=(",", ":"))


class ChatTemplater:
    """Renders a conversation's first prompt and the ids that continue it, turn by turn."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self._pieces: dict[str, _Pieces] = {}
        self._tools_matter: dict[str, bool] = {}

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The first prompt: `messages` rendered by the model's template, generation prompt on."""
        return await self.client.tokenize_chat(messages, add_generation_prompt=True, tools=tools)

    async def closing_ids(self, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids that end an assistant turn after its content (for Qwen: `<|im_end|>\\n`)."""
        return list((await self._derive(tools)).closing)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids to append after the model's last output to add `messages` and ask again.

        They close the assistant turn (only what the output lacks of the template's closing:
        for Qwen just "\\n" after an output that ended on `<|im_end|>`, the whole
        `<|im_end|>\\n` after one cut by a stop string or the length limit), then render the
        new messages as the template renders them after an assistant turn, then the
        generation prompt. Raises TemplateError if the template renders the start of a
        conversation differently once more messages follow it.
        """
        pieces = await self._derive(tools)
        render_with = tools if await self._tools_shape_messages(tools) else None
        suffix = await self._rendered_after_turn(messages, render_with)
        return self._close(last_output_ids, pieces.closing) + suffix

    async def _rendered_after_turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """`messages` and the generation prompt as the template renders them after an
        assistant turn (cut out of a render of the dummy conversation followed by them)."""
        pieces = await self._derive(tools)
        rendered = await self.client.tokenize_chat(
            [_DUMMY_USER, _DUMMY_ASSISTANT, *messages], add_generation_prompt=True, tools=tools
        )
        if rendered[: len(pieces.prompt)] != pieces.prompt:
            raise TemplateError(
                "the chat template renders the start of a conversation differently when more "
                "messages follow, so new messages cannot be appended as ids"
            )
        turn_end = pieces.content + pieces.closing
        at = _find(rendered, turn_end, len(pieces.prompt))
        if at < 0:
            raise TemplateError(
                "the chat template does not end an assistant turn the same way when more "
                "messages follow it"
            )
        return rendered[at + len(turn_end) :]

    async def _tools_shape_messages(self, tools: list[dict[str, Any]] | None) -> bool:
        """Whether the tool declarations change how later messages render.

        Templates such as Qwen's put the tools in the system prompt only; then every later
        turn can be rendered without them, which keeps each turn's render short. Decided
        once per tool set by rendering probe messages both ways.
        """
        if not tools:
            return False
        key = _tools_key(tools)
        if key not in self._tools_matter:
            with_tools = await self._rendered_after_turn(_PROBE, tools)
            without = await self._rendered_after_turn(_PROBE, None)
            self._tools_matter[key] = with_tools != without
        return self._tools_matter[key]

    @staticmethod
    def _close(output_ids: list[int], closing: list[int]) -> list[int]:
        # The longest start of the closing that the output already ends with (typically the
        # EOS it generated) is not repeated.
        for kept in range(min(len(closing), len(output_ids)), 0, -1):
            if output_ids[-kept:] == closing[:kept]:
                return closing[kept:]
        return list(closing)

    async def _derive(self, tools: list[dict[str, Any]] | None) -> _Pieces:
        key = _tools_key(tools)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        prompt = await self.client.tokenize_chat(
            [_DUMMY_USER], add_generation_prompt=True, tools=tools
        )
        turn = await self.client.tokenize_chat(
            [_DUMMY_USER, _DUMMY_ASSISTANT], add_generation_prompt=False, tools=tools
        )
        content = await self.client.tokenize(_DUMMY_TEXT)
        if turn[: len(prompt)] != prompt:
            raise TemplateError(
                "the chat template's generation prompt is not a prefix of the assistant turn "
                "it renders, so the model's output ids cannot simply follow the prompt"
            )
        at = _rfind(turn, content, len(prompt))
        if at < 0:
            raise TemplateError(
                "the chat template does not render an assistant message's content as its own "
                "ids, so the turn boundary cannot be found"
            )
        closing = turn[at + len(content) :]
        if not closing:
            raise TemplateError("the chat template renders nothing to end an assistant turn")
        pieces = _Pieces(prompt=prompt, content=content, closing=closing)
        self._pieces[key] = pieces
        return pieces


# ------------------------------------------------------- shaped as vLLM hands them to a template


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template.

    Text parts of list contents are joined with newlines, and JSON-string tool call arguments
    are parsed into objects (templates render them with `tojson`). Raises ValueError for
    arguments that are not valid JSON.
    """
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            m["content"] = "\n".join(t for t in texts if isinstance(t, str))
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if not args:
                    function["arguments"] = {}
                elif isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"tool call arguments are not valid JSON: {e}") from e
                call["function"] = function
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool definition as vLLM hands it to the chat template.

    vLLM parses `tools` into `{"type", "function": {"name", "description", "parameters"}}` and
    dumps them back, so the template sees those keys in that order, absent ones as null,
    followed by any extra keys.
    """
    function = dict(tool.get("function") or {})
    known = {
        "name": function.pop("name", None),
        "description": function.pop("description", None),
        "parameters": function.pop("parameters", None),
    }
    rest = {k: v for k, v in tool.items() if k not in ("type", "function")}
    return {"type": tool.get("type", "function"), "function": known | function} | rest
