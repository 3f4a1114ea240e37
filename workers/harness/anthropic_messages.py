"""Anthropic Messages (`POST /v1/messages`): its request body to a `ChatRequest`, a `ChatResult`
to its `message` object or its event stream, and `ApiError`s to its error body.

Anthropic's content blocks map onto the canonical (OpenAI-shaped) conversation: `system` becomes
a first system message, `tool_use` blocks an assistant's `tool_calls`, and the `tool_result`
blocks of a user turn one `tool` message each (in order) before a user message for its text.
Thinking blocks sent back in assistant turns are dropped (the chat template renders history
its own way); images, documents, server tools, structured output formats and `top_k` are
refused. What only tunes a hosted model (thinking, effort, caching, tier, speed, region) is
accepted and changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from workers.harness.wire import (
    ApiError,
    ChatRequest,
    ChatResult,
    ToolCallOut,
    expect,
    number,
    optional,
    param_name,
    positive_int,
    refuse,
    refuse_unknown,
    required,
    text_of,
    with_prefix,
)

_FIELDS = {
    "model",
    "max_tokens",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
    # Up to the served model and its template (thinking, effort), or hints to a hosted
    # service (caching, tier, speed, region, accounting): accepted, and nothing changes.
    "thinking",
    "output_config",
    "cache_control",
    "service_tier",
    "speed",
    "inference_geo",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
}

_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "cancelled": "invalid_request_error",
    "too_large": "request_too_large",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "budget": "rate_limit_error",
    "server": "api_error",
}


def parse_request(body: Any) -> ChatRequest:
    """The canonical request for a Messages body; `ApiError("invalid_request")` naming the
    field for anything malformed or not served."""
    body = expect(body, dict, "body")
    refuse_unknown(body, _FIELDS)
    if body.get("top_k") is not None:
        raise refuse("top_k", "is not supported: `temperature` and `top_p` are")
    max_tokens = positive_int(body, "max_tokens")
    if max_tokens is None:
        raise refuse("max_tokens", "is required")
    _check_ignored(body)
    raw_messages = required(body, "messages", list)
    if not raw_messages:
        raise refuse("messages", "must not be empty")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": text_of(body["system"], "system")})
    for i, raw in enumerate(raw_messages):
        messages.extend(_messages(raw, param_name("messages", i)))
    tools = _tools(body)
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 1.0),
        top_p=number(body, "top_p", 0.0, 1.0, above_low=True),
        stop=_stop_sequences(body),
        stream=bool(optional(body, "stream", bool)),
        model=optional(body, "model", str),
        parallel_tool_calls=parallel,
    )


def _stop_sequences(body: dict[str, Any]) -> list[str] | None:
    stops = optional(body, "stop_sequences", list) or []
    return [expect(s, str, param_name("stop_sequences", i)) for i, s in enumerate(stops)] or None


def _check_ignored(body: dict[str, Any]) -> None:
    """Check the types of the fields accepted and ignored; refuse a structured output format,
    which only a hosted model enforces."""
    for key in ("metadata", "thinking", "cache_control", "diagnostics"):
        optional(body, key, dict)
    for key in ("service_tier", "speed", "inference_geo", "user_profile_id", "workspace_id"):
        optional(body, key, str)
    output_config = optional(body, "output_config", dict) or {}
    optional(output_config, "effort", str, "output_config")
    if output_config.get("format") is not None:
        raise refuse("output_config.format", "is not supported: the output is plain text")


def _messages(raw: Any, where: str) -> list[dict[str, Any]]:
    """The canonical messages one Anthropic message becomes (one, or a user turn's tool
    results followed by its text)."""
    message = expect(raw, dict, where)
    role = required(message, "role", str, where)
    if role not in ("user", "assistant"):
        raise refuse(param_name(where, "role"), 'must be "user" or "assistant"')
    content = required(message, "content", object, where)
    at = param_name(where, "content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [expect(b, dict, param_name(at, j)) for j, b in enumerate(expect(content, list, at))]
    if not blocks:
        raise refuse(at, "must not be empty")
    if role == "assistant":
        return [_assistant(blocks, at)]
    return _user(blocks, at)


def _assistant(blocks: list[dict[str, Any]], at: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = param_name(at, j)
        kind = required(block, "type", str, where)
        if kind == "text":
            texts.append(required(block, "text", str, where))
        elif kind == "tool_use":
            arguments = required(block, "input", dict, where)
            function = {
                "name": required(block, "name", str, where),
                "arguments": json.dumps(arguments, ensure_ascii=False),
            }
            call_id = required(block, "id", str, where)
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind not in _DROPPED_BLOCKS:
            raise refuse(param_name(where, "type"), f"`{kind}` blocks are not served")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], at: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        where = param_name(at, j)
        kind = required(block, "type", str, where)
        if kind == "text":
            texts.append(required(block, "text", str, where))
        elif kind == "tool_result":
            # `is_error` is only checked: the result's text says what went wrong, and chat
            # templates have no place for the flag.
            optional(block, "is_error", bool, where)
            content = block.get("content")
            text = "" if content is None else text_of(content, param_name(where, "content"))
            call_id = required(block, "tool_use_id", str, where)
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise refuse(param_name(where, "type"), f"`{kind}` blocks are not served")
    if texts:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools: list[dict[str, Any]] = []
    for i, raw in enumerate(optional(body, "tools", list) or []):
        where = param_name("tools", i)
        tool = expect(raw, dict, where)
        if tool.get("type", "custom") != "custom":
            raise refuse(param_name(where, "type"), "server tools are not served")
        declared: dict[str, Any] = {"name": required(tool, "name", str, where)}
        description = optional(tool, "description", str, where)
        if description is not None:
            declared["description"] = description
        declared["parameters"] = required(tool, "input_schema", dict, where)
        tools.append({"type": "function", "function": declared})
    return tools or None


def _tool_choice(
    value: Any, tools: list[dict[str, Any]] | None
) -> tuple[str | dict[str, Any] | None, bool | None]:
    """The canonical tool choice, and False when parallel tool use was disabled."""
    if value is None:
        return None, None
    choice = expect(value, dict, "tool_choice")
    kind = required(choice, "type", str, "tool_choice")
    disabled = optional(choice, "disable_parallel_tool_use", bool, "tool_choice")
    parallel = None if disabled is None else not disabled
    if kind in ("auto", "none"):
        return kind, parallel
    names = {t["function"]["name"] for t in tools or []}
    if kind == "any":
        if not names:
            raise refuse("tool_choice.type", '"any" needs `tools`')
        return "required", parallel
    if kind == "tool":
        name = required(choice, "name", str, "tool_choice")
        if name not in names:
            raise refuse("tool_choice.name", f"no tool named `{name}` in `tools`")
        return {"type": "function", "function": {"name": name}}, parallel
    raise refuse("tool_choice.type", 'must be "auto", "any", "tool" or "none"')


def _input(call: ToolCallOut) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` must be (the tool call
    parser only yields objects; anything else becomes an empty one)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(result: ChatResult) -> list[dict[str, Any]]:
    """The content blocks: the text (also when empty and nothing else was said, since clients
    read `content[0]`), then a `tool_use` block per tool call."""
    blocks: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        blocks.append({"type": "text", "text": result.content})
    for call in result.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": with_prefix("toolu_", call.id),
                "name": call.name,
                "input": _input(call),
            }
        )
    return blocks


def _stop(result: ChatResult) -> tuple[str, str | None]:
    """`stop_reason` and `stop_sequence`. Tool calls win over "stop": Anthropic clients run
    their tools only when the reason is `tool_use`."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.tool_calls or result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return "end_turn", None


def response(result: ChatResult, request: ChatRequest | None = None) -> dict[str, Any]:
    """The `message` object for `result` (`request` is not needed by this shape)."""
    stop_reason, stop_sequence = _stop(result)
    return {
        "id": with_prefix("msg_", result.id),
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": _blocks(result),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


def stream_events(result: ChatResult, request: ChatRequest) -> list[str]:
    """The server-sent events streaming `result`: `message_start`, each block as
    `content_block_start`, one delta (`text_delta` or `input_json_delta`) and
    `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`."""
    whole = response(result, request)
    start = {
        **whole,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": 0},
    }
    events = [_event("message_start", {"message": start})]
    for index, block in enumerate(whole["content"]):
        empty: dict[str, Any]
        if block["type"] == "text":
            empty = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(_event("content_block_start", {"index": index, "content_block": empty}))
        if block["type"] != "text" or block["text"]:
            events.append(_event("content_block_delta", {"index": index, "delta": delta}))
        events.append(_event("content_block_stop", {"index": index}))
    stop = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    events.append(_event("message_delta", {"delta": stop, "usage": whole["usage"]}))
    events.append(_event("message_stop", {}))
    return events


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error object for `err` (its message names the field, when there is one)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES[err.kind], "message": err.message}}
