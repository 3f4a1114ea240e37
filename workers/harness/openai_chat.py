"""OpenAI Chat Completions (`POST /v1/chat/completions`): its request body to a `ChatRequest`,
a `ChatResult` to its `chat.completion` object or its stream of `chat.completion.chunk`s, and
`ApiError`s to its error body.

What would make the answer differ from what the client asked for is refused with the field
named (more than one choice, non-text content, logit bias, penalties, top logprobs, JSON
modes, unknown fields); what only describes the caller (`user`, `metadata`, `store`) or tunes
a hosted model (`reasoning_effort`, `service_tier`) is accepted and ignored.
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
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "user",
    "metadata",
    "store",
    "reasoning_effort",
    "response_format",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    # Caching and routing hints of hosted models: nothing to do with sampling.
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
}

_IGNORED_TEXT = (
    "user",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
)
"""Fields accepted and ignored, checked to be strings."""

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "too_large": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "cancelled": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "budget": "rate_limit_error",
    "server": "server_error",
}

_ERROR_CODES = {
    "context_length": "context_length_exceeded",
    "authentication": "invalid_api_key",
    # What OpenAI answers when a quota is spent: clients treat it as final, not as a retry.
    "budget": "insufficient_quota",
    "cancelled": "job_cancelled",
}


def parse_request(body: Any) -> ChatRequest:
    """The canonical request for a Chat Completions body; `ApiError("invalid_request")` naming
    the field for anything malformed or not served."""
    body = expect(body, dict, "body")
    refuse_unknown(body, _FIELDS)
    _refuse_unserved(body)
    raw_messages = required(body, "messages", list)
    if not raw_messages:
        raise refuse("messages", "must not be empty")
    tools = _tools(body)
    stream_options = optional(body, "stream_options", dict) or {}
    return ChatRequest(
        messages=[_message(m, param_name("messages", i)) for i, m in enumerate(raw_messages)],
        tools=tools,
        tool_choice=tool_choice(body.get("tool_choice"), tools),
        max_tokens=_max_tokens(body),
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0, above_low=True),
        seed=optional(body, "seed", int),
        stop=_stop(body.get("stop")),
        logprobs=bool(optional(body, "logprobs", bool)),
        stream=bool(optional(body, "stream", bool)),
        stream_usage=bool(optional(stream_options, "include_usage", bool, "stream_options")),
        model=optional(body, "model", str),
        parallel_tool_calls=optional(body, "parallel_tool_calls", bool),
    )


def _refuse_unserved(body: dict[str, Any]) -> None:
    """Refuse the fields whose values would need what the endpoint does not do; check the
    types of those accepted and ignored."""
    if optional(body, "n", int) not in (None, 1):
        raise refuse("n", "must be 1: one choice is generated per request")
    if body.get("logit_bias"):
        raise refuse("logit_bias", "is not supported: the policy's logprobs must stay its own")
    for key in ("presence_penalty", "frequency_penalty"):
        if optional(body, key, float) not in (None, 0.0):
            raise refuse(key, "must be 0: penalties would change the policy's distribution")
    if optional(body, "top_logprobs", int) not in (None, 0):
        raise refuse("top_logprobs", "must be 0: only the sampled tokens' logprobs are kept")
    response_format = optional(body, "response_format", dict)
    if response_format is not None and response_format.get("type") != "text":
        raise refuse("response_format.type", 'only "text" is served (no JSON modes)')
    for key in _IGNORED_TEXT:
        optional(body, key, str)
    optional(body, "metadata", dict)
    optional(body, "store", bool)


def _max_tokens(body: dict[str, Any]) -> int | None:
    legacy, current = positive_int(body, "max_tokens"), positive_int(body, "max_completion_tokens")
    if legacy is not None and current is not None and legacy != current:
        raise refuse("max_completion_tokens", "differs from `max_tokens`; send one of them")
    return current if current is not None else legacy


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    items = expect(value, list, "stop")
    return [expect(s, str, param_name("stop", i)) for i, s in enumerate(items)] or None


def _message(raw: Any, where: str) -> dict[str, Any]:
    """One message in the canonical shape: `developer` becomes `system`, content becomes text."""
    message = expect(raw, dict, where)
    role = required(message, "role", str, where)
    content = param_name(where, "content")
    out: dict[str, Any]
    if role in ("system", "developer", "user"):
        text = text_of(required(message, "content", object, where), content)
        out = {"role": "system" if role == "developer" else role, "content": text}
    elif role == "assistant":
        out = _assistant(message, where)
    elif role == "tool":
        out = {
            "role": "tool",
            "tool_call_id": required(message, "tool_call_id", str, where),
            "content": text_of(required(message, "content", object, where), content),
        }
    else:
        raise refuse(param_name(where, "role"), f"unknown role `{role}`")
    name = optional(message, "name", str, where)
    if name is not None:
        out["name"] = name
    return out


def _assistant(message: dict[str, Any], where: str) -> dict[str, Any]:
    # The SDK sends back the message it was given, nulls included: nulls are fine, a legacy
    # function call or audio is not.
    for key in ("function_call", "audio"):
        if message.get(key) is not None:
            raise refuse(param_name(where, key), "is not supported; use `tool_calls`")
    content = message.get("content")
    text = "" if content is None else text_of(content, param_name(where, "content"))
    out: dict[str, Any] = {"role": "assistant", "content": text}
    calls = optional(message, "tool_calls", list, where)
    if calls:
        calls_at = param_name(where, "tool_calls")
        out["tool_calls"] = [_tool_call(c, param_name(calls_at, j)) for j, c in enumerate(calls)]
    for key in ("reasoning_content", "reasoning"):
        reasoning = optional(message, key, str, where)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    return out


def _tool_call(raw: Any, where: str) -> dict[str, Any]:
    call = expect(raw, dict, where)
    if call.get("type", "function") != "function":
        raise refuse(param_name(where, "type"), 'only "function" tool calls are served')
    function = required(call, "function", dict, where)
    at = param_name(where, "function")
    return {
        "id": required(call, "id", str, where),
        "type": "function",
        "function": {
            "name": required(function, "name", str, at),
            "arguments": required(function, "arguments", str, at),
        },
    }


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools: list[dict[str, Any]] = []
    for i, raw in enumerate(optional(body, "tools", list) or []):
        where = param_name("tools", i)
        tool = expect(raw, dict, where)
        if tool.get("type") != "function":
            raise refuse(param_name(where, "type"), 'only "function" tools are served')
        function = required(tool, "function", dict, where)
        at = param_name(where, "function")
        declared: dict[str, Any] = {"name": required(function, "name", str, at)}
        description = optional(function, "description", str, at)
        if description is not None:
            declared["description"] = description
        parameters = optional(function, "parameters", dict, at)
        if parameters is not None:
            declared["parameters"] = parameters
        tools.append({"type": "function", "function": declared})
    return tools or None


def tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """The canonical tool choice for OpenAI's `tool_choice` (a mode, or a function named in
    canonical `tools`); None when absent."""
    if value is None:
        return None
    names = {t["function"]["name"] for t in tools or []}
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise refuse("tool_choice", 'must be "auto", "none", "required" or a function')
        if value == "required" and not names:
            raise refuse("tool_choice", '"required" needs `tools`')
        return value
    choice = expect(value, dict, "tool_choice")
    if choice.get("type") != "function":
        raise refuse("tool_choice.type", 'only "function" is served')
    name = required(required(choice, "function", dict, "tool_choice"), "name", str)
    if name not in names:
        raise refuse("tool_choice.function.name", f"no tool named `{name}` in `tools`")
    return {"type": "function", "function": {"name": name}}


def _logprobs(result: ChatResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    content = [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": lp.bytes if lp.bytes is not None else list(lp.token.encode()),
            "top_logprobs": [],
        }
        for lp in result.logprobs
    ]
    return {"content": content, "refusal": None}


def _usage(result: ChatResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _call_out(call: ToolCallOut) -> dict[str, Any]:
    return {
        "id": with_prefix("call_", call.id),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def response(result: ChatResult, request: ChatRequest | None = None) -> dict[str, Any]:
    """The `chat.completion` object for `result` (`request` is not needed by this shape)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if result.tool_calls and not result.content else result.content,
        "refusal": None,
    }
    if result.tool_calls:
        message["tool_calls"] = [_call_out(c) for c in result.tool_calls]
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    choice = {
        "index": 0,
        "message": message,
        "logprobs": _logprobs(result),
        "finish_reason": result.finish_reason,
    }
    return {
        "id": with_prefix("chatcmpl-", result.id),
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": [choice],
        "usage": _usage(result),
    }


def stream_events(result: ChatResult, request: ChatRequest) -> list[str]:
    """The server-sent events streaming `result`: a role chunk, the reasoning and the content
    (carrying the logprobs, when asked), one chunk per tool call, a finish chunk, a usage
    chunk when `stream_options.include_usage` asked for it, and `[DONE]`."""
    base = {
        "id": with_prefix("chatcmpl-", result.id),
        "object": "chat.completion.chunk",
        "created": result.created,
        "model": result.model,
    }

    def chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, **choice}]}
        if request.stream_usage:
            body["usage"] = None  # as OpenAI does: only the last chunk carries usage
        return body

    logprobs = _logprobs(result)
    chunks = [chunk({"role": "assistant", "content": ""}, finish_reason=None)]
    if result.reasoning is not None:
        chunks.append(chunk({"reasoning_content": result.reasoning}, finish_reason=None))
    if result.content:
        chunks.append(chunk({"content": result.content}, logprobs=logprobs, finish_reason=None))
        logprobs = None
    for index, call in enumerate(result.tool_calls):
        delta = {"tool_calls": [{"index": index, **_call_out(call)}]}
        chunks.append(chunk(delta, finish_reason=None))
    chunks.append(chunk({}, logprobs=logprobs, finish_reason=result.finish_reason))
    if request.stream_usage:
        chunks.append({**base, "choices": [], "usage": _usage(result)})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error object for `err`."""
    return {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES[err.kind],
            "param": err.param,
            "code": _ERROR_CODES.get(err.kind),
        }
    }
