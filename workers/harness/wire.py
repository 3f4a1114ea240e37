"""The canonical request and result every API shape of the harness endpoint translates to.

Messages and tools are kept in the OpenAI Chat Completions shape (what chat templates are
written against, through vLLM): `{"role": "system"|"user"|"assistant"|"tool", "content": str,
"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON text}}],
"tool_call_id": str}` and `[{"type": "function", "function": {"name", "description",
"parameters"}}]`. An API shape parses its request body into a `ChatRequest` (raising
`ApiError` for what it cannot serve), the session generates a `ChatResult`, and the shape
turns it into its response body or its stream of server-sent events.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "rate_limit",
    "context_length",
    "budget",
    "cancelled",
    "server",
    "too_large",
    "method_not_allowed",
]
"""What went wrong, independent of the API: each shape maps it to its own error type."""

STATUS: dict[str, int] = {
    "invalid_request": 400,
    "context_length": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "budget": 429,
    "rate_limit": 429,
    "cancelled": 409,
    "server": 502,
    "too_large": 413,
    "method_not_allowed": 405,
}


class ApiError(Exception):
    """A request the endpoint refuses or could not serve; `kind` picks the HTTP status and the
    API's own error type, `param` names the offending field when there is one."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return STATUS[self.kind]


@dataclass
class ChatRequest:
    """One model call as every API shape asks for it."""

    messages: list[dict[str, Any]]
    """The conversation in the OpenAI Chat Completions shape (system prompt first, if any)."""
    tools: list[dict[str, Any]] | None = None
    """Tool declarations in the OpenAI shape; None without tools."""
    tool_choice: str | dict[str, Any] | None = None
    """`auto`, `none`, `required`, or `{"type": "function", "function": {"name"}}`."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    """Return the sampled tokens' logprobs (OpenAI shapes)."""
    stream: bool = False
    stream_usage: bool = False
    """OpenAI `stream_options.include_usage`: a last chunk carrying `usage`."""
    model: str | None = None
    """The model name the client asked for (echoed back; the job's policy answers)."""
    parallel_tool_calls: bool | None = None
    """False when the client asked for at most one tool call per turn; None when it did not
    say (OpenAI `parallel_tool_calls`, Anthropic `disable_parallel_tool_use`)."""


@dataclass
class ToolCallOut:
    """A tool call parsed from the generated text."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (what the OpenAI and Anthropic shapes carry)."""


@dataclass
class TokenLogprob:
    token: str
    """The token's text (its bytes decoded, replacement characters where a token is part of
    a character)."""
    logprob: float
    bytes: list[int] | None = None
    """The token's own bytes when known (a token can be part of a UTF-8 character); the
    shapes send the UTF-8 of `token` otherwise."""


@dataclass
class ChatResult:
    """What the policy answered, parsed; built from the exact ids the engine returned."""

    id: str
    """The response id (`chatcmpl-...`, `msg_...`, `resp_...` are made from it)."""
    model: str
    content: str
    """The generated text without the tool call blocks (all of it when none parsed)."""
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    reasoning: str | None = None
    """Text the model wrote between `<think>` and `</think>`, when it did."""
    finish_reason: Literal["stop", "length", "tool_calls"] = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    """One per generated id, when the request asked for them."""
    created: int = 0
    """Unix time of the answer."""
    stop_sequence: str | None = None
    """The request's stop string that ended the generation (finish_reason "stop"), if one did;
    Anthropic reports it as `stop_reason` "stop_sequence"."""


# Reading request bodies. Every shape checks its fields with these, so that each refusal names
# the field as the client sent it (`messages[2].content[0].type`).

T = TypeVar("T")

_KIND_NAMES: dict[type, str] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    dict: "an object",
    list: "an array",
}


def param_name(where: str, key: str | int) -> str:
    """`where` extended by a key (`messages[0]`, `content` → `messages[0].content`) or an
    index (`messages`, 0 → `messages[0]`)."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def refuse(param: str, message: str) -> ApiError:
    """An `invalid_request` error about `param`, its message naming it."""
    return ApiError("invalid_request", f"`{param}`: {message}", param=param)


def expect(value: Any, kind: type[T], param: str) -> T:
    """`value` when it is a `kind` (integers count as numbers, booleans as neither); an
    `invalid_request` error naming `param` otherwise."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return cast(T, float(value))
    if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
        return value
    raise refuse(param, f"must be {_KIND_NAMES.get(kind, kind.__name__)}")


def optional(obj: dict[str, Any], key: str, kind: type[T], where: str = "") -> T | None:
    """`obj[key]` checked by `expect`; None when it is absent or null."""
    value = obj.get(key)
    return None if value is None else expect(value, kind, param_name(where, key))


def required(obj: dict[str, Any], key: str, kind: type[T], where: str = "") -> T:
    """`obj[key]` checked by `expect`; an error naming it when it is absent or null."""
    if obj.get(key) is None:
        raise refuse(param_name(where, key), "is required")
    return expect(obj[key], kind, param_name(where, key))


def number(
    obj: dict[str, Any], key: str, low: float, high: float, *, above_low: bool = False
) -> float | None:
    """`obj[key]` as a number within [low, high] (or (low, high] with `above_low`); None when
    absent. NaN fails every comparison, so it is refused too."""
    value = optional(obj, key, float)
    if value is None:
        return None
    if not (low < value <= high if above_low else low <= value <= high):
        bounds = f"({low}, {high}]" if above_low else f"[{low}, {high}]"
        raise refuse(key, f"must be a number in {bounds}")
    return value


def positive_int(obj: dict[str, Any], key: str) -> int | None:
    """`obj[key]` as an integer of at least 1; None when absent."""
    value = optional(obj, key, int)
    if value is not None and value < 1:
        raise refuse(key, "must be at least 1")
    return value


def refuse_unknown(obj: dict[str, Any], known: Collection[str], where: str = "") -> None:
    """Refuse the first (in sorted order) key of `obj` that is not `known`: an unknown field
    may change how the model samples, and silently ignoring it would hide that."""
    unknown = sorted(key for key in obj if key not in known)
    if unknown:
        raise refuse(param_name(where, unknown[0]), "is not supported by this endpoint")


def text_of(content: Any, param: str, text_types: Collection[str] = ("text",)) -> str:
    """The text of a message's content: a string, or a list of text parts (whose `type` is one
    of `text_types`) joined by newlines. Any other part (an image, audio, a file) is refused
    by its `type`, since the endpoint serves a text-only model."""
    if isinstance(content, str):
        return content
    parts = expect(content, list, param)
    texts: list[str] = []
    for i, raw in enumerate(parts):
        where = param_name(param, i)
        part = expect(raw, dict, where)
        kind = required(part, "type", str, where)
        if kind not in text_types:
            raise refuse(
                param_name(where, "type"), f"only text content is served, not `{kind}` parts"
            )
        texts.append(required(part, "text", str, where))
    return "\n".join(texts)


def with_prefix(prefix: str, raw: str) -> str:
    """`raw` as an id of the API's kind (`call_...`, `toolu_...`): `prefix` added unless `raw`
    has it already (an id made in the API's form is shown as it is)."""
    return raw if raw.startswith(prefix) else prefix + raw
