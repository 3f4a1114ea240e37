"""Request bodies and error shapes of the vLLM OpenAI server, as far as rollserve uses it.

Field names, defaults and error bodies follow vLLM's `CompletionRequest`,
`TokenizeCompletionRequest`, `TokenizeChatRequest`, `DetokenizeRequest` and `ErrorResponse`.
Unknown fields are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]

SAMPLING_EPS = 1e-5
"""Temperatures below this sample greedily, as in vLLM."""

LOGPROB_FLOOR = -9999.0
"""vLLM reports `-inf` logprobs as this finite value so that the JSON stays valid."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionRequest(_Lenient):
    """Body of `POST /v1/completions`."""

    model: str | None = None
    prompt: list[NonNegInt] | list[list[NonNegInt]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    request_id: str | None = None


class TokenizeCompletionRequest(_Lenient):
    """Body of `POST /tokenize` with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Lenient):
    """Body of `POST /tokenize` with chat messages, rendered by the model's chat template."""

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Lenient):
    """Body of `POST /detokenize`."""

    model: str | None = None
    tokens: list[NonNegInt]


class RequestError(Exception):
    """A request the server refuses; rendered as vLLM's `{"error": {...}}` body."""

    def __init__(
        self, message: str, status: int = 400, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind or _error_type(status)

    def body(self) -> dict[str, Any]:
        """The JSON body vLLM sends with this status."""
        return error_body(self.message, self.status, param=self.param, kind=self.kind)


def _error_type(status: int) -> str:
    # vLLM names the error after the HTTP status: BadRequestError, NotFoundError, ...
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return phrase if phrase.endswith("Error") else f"{phrase}Error"


def error_body(
    message: str, status: int, *, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": message,
            "type": kind or _error_type(status),
            "param": param,
            "code": status,
        }
    }


def tool_for_template(tool: dict[str, Any]) -> dict[str, Any]:
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
