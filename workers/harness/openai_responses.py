"""The OpenAI Responses API (`POST /v1/responses`, what Codex-style agents speak): its request
body to a `ChatRequest`, a `ChatResult` to its `response` object or its event stream, and
`ApiError`s to its error body (OpenAI's, as for Chat Completions).

Input items map onto the canonical conversation: `instructions` becomes a first system
message, messages keep their role (`developer` as `system`), a `function_call` joins the
assistant message before it (or starts one), each `function_call_output` becomes a `tool`
message, and `reasoning` items are dropped. Nothing is kept server-side, so
`previous_response_id` is refused: the client sends the whole conversation, as it does with
`store: false`.
"""

from __future__ import annotations

import json
from typing import Any

from workers.harness import openai_chat
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
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "metadata",
    "reasoning",
    "text",
    "include",
    "user",
    "truncation",
    # Caching and routing hints of hosted models: nothing to do with sampling.
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
}

_TEXT_PARTS = ("input_text", "output_text")

_LOGPROBS = "message.output_text.logprobs"
"""The `include` entry asking for the output text's logprobs."""


def parse_request(body: Any) -> ChatRequest:
    """The canonical request for a Responses body; `ApiError("invalid_request")` naming the
    field for anything malformed or not served."""
    body = expect(body, dict, "body")
    refuse_unknown(body, _FIELDS)
    include = _refuse_unserved(body)
    messages: list[dict[str, Any]] = []
    instructions = optional(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw_input = required(body, "input", object)
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    else:
        items = expect(raw_input, list, "input")
        for i, item in enumerate(items):
            _add_item(messages, item, param_name("input", i))
    if not messages:
        raise refuse("input", "must not be empty")
    tools = _tools(body)
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=positive_int(body, "max_output_tokens"),
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0, above_low=True),
        logprobs=_LOGPROBS in include,
        stream=bool(optional(body, "stream", bool)),
        model=optional(body, "model", str),
        parallel_tool_calls=optional(body, "parallel_tool_calls", bool),
    )


def _refuse_unserved(body: dict[str, Any]) -> list[str]:
    """Refuse what the endpoint cannot do, check the types of what it ignores, and return the
    `include` entries."""
    if body.get("previous_response_id") is not None:
        raise refuse(
            "previous_response_id",
            "is not supported: nothing is stored server-side; send the whole conversation",
        )
    if optional(body, "top_logprobs", int) not in (None, 0):
        raise refuse("top_logprobs", "must be 0: only the sampled tokens' logprobs are kept")
    if optional(body, "truncation", str) not in (None, "disabled"):
        raise refuse("truncation", 'only "disabled" is served: the history is never cut')
    text = optional(body, "text", dict) or {}
    text_format = optional(text, "format", dict, "text")
    if text_format is not None and text_format.get("type") != "text":
        raise refuse("text.format.type", 'only "text" is served (no JSON modes)')
    for key in ("user", "prompt_cache_key", "safety_identifier", "service_tier"):
        optional(body, key, str)
    for key in ("metadata", "reasoning", "stream_options"):
        optional(body, key, dict)
    optional(body, "store", bool)
    include = optional(body, "include", list) or []
    return [expect(entry, str, param_name("include", i)) for i, entry in enumerate(include)]


def _add_item(messages: list[dict[str, Any]], raw: Any, where: str) -> None:
    """Append what one input item becomes to `messages`."""
    item = expect(raw, dict, where)
    kind = optional(item, "type", str, where) or "message"
    if kind == "message":
        role = required(item, "role", str, where)
        if role not in ("user", "assistant", "system", "developer"):
            raise refuse(param_name(where, "role"), f"unknown role `{role}`")
        text = text_of(
            required(item, "content", object, where), param_name(where, "content"), _TEXT_PARTS
        )
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call = {
            "id": required(item, "call_id", str, where),
            "type": "function",
            "function": {
                "name": required(item, "name", str, where),
                "arguments": required(item, "arguments", str, where),
            },
        }
        # Calls of one turn follow its message (or each other): they are one assistant turn.
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = required(item, "output", object, where)
        messages.append(
            {
                "role": "tool",
                "tool_call_id": required(item, "call_id", str, where),
                "content": text_of(output, param_name(where, "output"), _TEXT_PARTS),
            }
        )
    elif kind != "reasoning":
        raise refuse(param_name(where, "type"), f"`{kind}` items are not served")


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools: list[dict[str, Any]] = []
    for i, raw in enumerate(optional(body, "tools", list) or []):
        where = param_name("tools", i)
        tool = expect(raw, dict, where)
        if tool.get("type") != "function":
            raise refuse(param_name(where, "type"), 'only "function" tools are served')
        declared: dict[str, Any] = {"name": required(tool, "name", str, where)}
        description = optional(tool, "description", str, where)
        if description is not None:
            declared["description"] = description
        parameters = optional(tool, "parameters", dict, where)
        if parameters is not None:
            declared["parameters"] = parameters
        tools.append({"type": "function", "function": declared})
    return tools or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    if value is None or isinstance(value, str):
        return openai_chat.tool_choice(value, tools)
    choice = expect(value, dict, "tool_choice")
    if choice.get("type") != "function":
        raise refuse("tool_choice.type", 'only "function" is served')
    name = required(choice, "name", str, "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise refuse("tool_choice.name", f"no tool named `{name}` in `tools`")
    return {"type": "function", "function": {"name": name}}


def _echo_tools(request: ChatRequest | None) -> list[dict[str, Any]]:
    """The request's tools in the Responses shape, as the response object repeats them."""
    tools = request.tools if request is not None else None
    return [
        {
            "type": "function",
            "name": t["function"]["name"],
            "description": t["function"].get("description"),
            "parameters": t["function"].get("parameters"),
            "strict": False,
        }
        for t in tools or []
    ]


def _echo_tool_choice(request: ChatRequest | None) -> str | dict[str, Any]:
    choice = request.tool_choice if request is not None else None
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"


def _text_part(result: ChatResult) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": result.content, "annotations": []}
    if result.logprobs is not None:
        part["logprobs"] = [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": lp.bytes if lp.bytes is not None else list(lp.token.encode()),
                "top_logprobs": [],
            }
            for lp in result.logprobs
        ]
    return part


def _function_call(call: ToolCallOut, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": with_prefix("fc_", call.id),
        "call_id": with_prefix("call_", call.id),
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _output(result: ChatResult) -> list[dict[str, Any]]:
    """The output items: the message (also when empty and nothing else was said), then a
    `function_call` item per tool call."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        message = {
            "type": "message",
            "id": with_prefix("msg_", result.id),
            "role": "assistant",
            "status": status,
            "content": [_text_part(result)],
        }
        items.append(message)
    items.extend(_function_call(call, status) for call in result.tool_calls)
    return items


def response(result: ChatResult, request: ChatRequest | None = None) -> dict[str, Any]:
    """The `response` object for `result`; `request` supplies what the object repeats (tools,
    tool choice, sampling), as the API does. A generation cut by the token limit is
    `incomplete` with `max_output_tokens` as the reason."""
    incomplete = result.finish_reason == "length"
    return {
        "id": with_prefix("resp_", result.id),
        "object": "response",
        "created_at": result.created,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": result.model,
        "instructions": None,
        "output": _output(result),
        "tools": _echo_tools(request),
        "tool_choice": _echo_tool_choice(request),
        "parallel_tool_calls": request is None or request.parallel_tool_calls is not False,
        "temperature": request.temperature if request is not None else None,
        "top_p": request.top_p if request is not None else None,
        "max_output_tokens": request.max_tokens if request is not None else None,
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "metadata": {},
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }


_Event = tuple[str, dict[str, Any]]


def _message_events(item: dict[str, Any], at: dict[str, int]) -> list[_Event]:
    """A message item added, its text part added, its text in one delta, and both done."""
    part = item["content"][0]
    logprobs = part.get("logprobs", [])
    text_at = {"item_id": item["id"], **at, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": []}
    added = {**item, "status": "in_progress", "content": []}
    return [
        ("response.output_item.added", {**at, "item": added}),
        ("response.content_part.added", {**text_at, "part": empty}),
        ("response.output_text.delta", {**text_at, "delta": part["text"], "logprobs": logprobs}),
        ("response.output_text.done", {**text_at, "text": part["text"], "logprobs": logprobs}),
        ("response.content_part.done", {**text_at, "part": part}),
        ("response.output_item.done", {**at, "item": item}),
    ]


def _call_events(item: dict[str, Any], at: dict[str, int]) -> list[_Event]:
    """A function call item added, its arguments in one delta, and done."""
    args_at = {"item_id": item["id"], **at}
    added = {**item, "status": "in_progress", "arguments": ""}
    done = {**args_at, "name": item["name"], "arguments": item["arguments"]}
    return [
        ("response.output_item.added", {**at, "item": added}),
        ("response.function_call_arguments.delta", {**args_at, "delta": item["arguments"]}),
        ("response.function_call_arguments.done", done),
        ("response.output_item.done", {**at, "item": item}),
    ]


def stream_events(result: ChatResult, request: ChatRequest) -> list[str]:
    """The server-sent events streaming `result`, numbered by `sequence_number`:
    `response.created`, `response.in_progress`, each output item added, filled (text part and
    its delta, or the arguments' delta) and done, then `response.completed` (or
    `response.incomplete` when the token limit cut it, as the API does)."""
    whole = response(result, request)
    pending = {**whole, "status": "in_progress", "incomplete_details": None, "output": []}
    pending["usage"] = None
    events: list[_Event] = [
        ("response.created", {"response": pending}),
        ("response.in_progress", {"response": pending}),
    ]
    for index, item in enumerate(whole["output"]):
        at = {"output_index": index}
        events += _message_events(item, at) if item["type"] == "message" else _call_events(item, at)
    done = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    events.append((done, {"response": whole}))
    return [
        f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': n, **data})}\n\n"
        for n, (name, data) in enumerate(events)
    ]


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error object for `err`."""
    return openai_chat.error_body(err)
