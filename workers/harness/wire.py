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

from dataclasses import dataclass, field
from typing import Any, Literal

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
