"""One job's model calls as token ids: the bookkeeping the agent loop and the harness endpoint
share.

Each call is asked for with the whole conversation as chat messages. When they are the last
call's messages, then its reply as it was returned, then new messages, the new messages alone
are rendered and appended after the ids the model generated (`ChatTemplater.continuation_ids`):
nothing already in the sequence is tokenized again. Otherwise (a harness edited, truncated or
summarised its history, changed its tools, sent a reply back altered, or asked again) the whole
conversation is rendered by the model's template; when those ids still extend the sequence, the
new ones are appended as an observation, and when they do not, the call starts a new segment
and the reason is recorded (`core.schemas.SEGMENT_REASONS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from core.schemas import ModelTurn
from routing.chat import TemplateError
from routing.protocol import Completion
from workers.trajectory import TrajectoryBuilder


class Templater(Protocol):
    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


@dataclass(frozen=True)
class Prompt:
    """What the next call adds: `ids` appended after the sequence (`segment` None), or the
    whole prompt of a new segment (`segment` says why)."""

    ids: list[int]
    segment: str | None
    text: str = ""
    """The new messages' text, for the environment turn that records appended ids."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normal_form(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message the chat template renders, in a form two senders agree on: the role,
    the text (outer whitespace aside), tool calls by name and parsed arguments (their ids
    aside), and the tool call a result answers."""
    calls = tuple(
        (
            str((c.get("function") or {}).get("name")),
            json.dumps(_arguments((c.get("function") or {}).get("arguments")), sort_keys=True),
        )
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    )
    return (
        message.get("role"),
        _text(message.get("content")).strip(),
        calls,
        message.get("tool_call_id") if message.get("role") == "tool" else None,
    )


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if len(a) != len(b):
        return False
    return all(x is y or normal_form(x) == normal_form(y) for x, y in zip(a, b, strict=True))


class Conversation:
    """The sequence of one job's model calls: plans each call's prompt from its messages and
    records what the model answered (into `builder`)."""

    def __init__(self, templater: Templater) -> None:
        self.templater = templater
        self.builder: TrajectoryBuilder | None = None
        self.messages: list[dict[str, Any]] = []
        """The messages the last call was asked with."""
        self.tools: list[dict[str, Any]] | None = None
        self.reply: dict[str, Any] | None = None
        """The last call's answer as an assistant message, as it was returned."""
        self._last_output: list[int] = []

    @classmethod
    def restored(
        cls,
        templater: Templater,
        builder: TrajectoryBuilder,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        reply: dict[str, Any],
    ) -> Conversation:
        """The conversation that recorded `builder`'s turns: its last call was asked with
        `messages` and `tools` (or its reply already followed, in `messages`) and answered
        `reply` (`workers.resume`)."""
        last = [t for t in builder.turns if isinstance(t, ModelTurn)][-1]
        conversation = cls(templater)
        conversation.builder = builder
        conversation.messages = messages
        conversation.tools = tools
        conversation.reply = reply
        conversation._last_output = list(last.output_ids)
        return conversation

    @property
    def sequence_length(self) -> int:
        return 0 if self.builder is None else self.builder.sequence_length

    async def plan(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        segment: str | None = None,
    ) -> Prompt:
        """The ids the call asked with `messages` and `tools` adds (see the module docstring);
        nothing is recorded until `commit`. With `segment`, the call begins a new segment for
        that reason, its whole prompt rendered (the loop's own compaction)."""
        if self.builder is None or self.reply is None:
            return Prompt(await self.templater.prompt_ids(messages, tools), "start")
        if segment is not None:
            return Prompt(await self.templater.prompt_ids(messages, tools), segment)
        why = self._divergence(messages, tools)
        if why is None:
            new = messages[len(self.messages) + 1 :]
            text = "\n".join(_text(m.get("content")) for m in new)
            try:
                ids = await self.templater.continuation_ids(self._last_output, new, tools)
                return Prompt(ids, None, text)
            except TemplateError:
                why = "rerendered"
        rendered = await self.templater.prompt_ids(messages, tools)
        sequence = self.builder.sequence
        if len(rendered) > len(sequence) and rendered[: len(sequence)] == sequence:
            return Prompt(rendered[len(sequence) :], None)
        return Prompt(rendered, why or "rerendered")

    def _divergence(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> str | None:
        """Why `messages` do not continue the last call (None when they do)."""
        n = len(self.messages)
        if tools is not self.tools and (tools or None) != (self.tools or None):
            return "tools_changed"
        if _same(messages, self.messages):
            return "retried"
        if len(messages) <= n or not _same(messages[:n], self.messages):
            return "history_changed"
        assert self.reply is not None
        sent = messages[n]
        if sent is not self.reply and normal_form(sent) != normal_form(self.reply):
            return "reply_changed"
        return None

    def commit(
        self,
        prompt: Prompt,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_seconds: float = 0.0,
    ) -> None:
        """Record `prompt` (planned for `messages` and `tools`) as the next call's."""
        if self.builder is None:
            self.builder = TrajectoryBuilder(prompt.ids)
        elif prompt.segment is not None:
            self.builder.start_segment(prompt.ids, prompt.segment)
        else:
            self.builder.add_env_turn(prompt.ids, text=prompt.text, tool_seconds=tool_seconds)
        self.messages = messages
        self.tools = tools

    def record(
        self,
        completion: Completion,
        reply: dict[str, Any],
        llm_seconds: float,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> ModelTurn:
        """Record the model's answer to the committed prompt; `reply` is the assistant message
        it is returned as (the next call continues when it is sent back so)."""
        assert self.builder is not None, "commit a prompt before recording its answer"
        turn = self.builder.add_model_turn(
            completion.output_ids,
            completion.logprobs,
            completion.text,
            completion.finish_reason,
            llm_seconds=llm_seconds,
            tool_calls=tool_calls,
            backend_id=completion.backend_id,
            policy_version=completion.policy_version,
        )
        self.reply = reply
        self._last_output = list(completion.output_ids)
        return turn
