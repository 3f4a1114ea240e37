"""Request bodies and error shapes of the APIs the development server speaks.

vLLM's OpenAI server: field names, defaults and error bodies follow vLLM's
`CompletionRequest`, `TokenizeCompletionRequest`, `TokenizeChatRequest`, `DetokenizeRequest`
and `ErrorResponse`; vLLM's tokens-in/tokens-out `GenerateRequest` (`/inference/v1/generate`,
`vllm/entrypoints/serve/disagg/protocol.py`) with its `SamplingParams`. SGLang's native API:
`GenerateReqInput` (`/generate`) with SGLang's `SamplingParams`, and `AbortReq`
(`/abort_request`). Unknown fields are accepted and ignored, as both servers do.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from routing.chat import template_tool

NonNegInt = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""A sampling seed: a signed 64-bit integer, as vLLM bounds it (400 beyond)."""

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
    seed: Seed | None = None
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
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)


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
    """Body of `POST /detokenize`: vLLM's (special tokens kept, answered with `prompt`), or
    SGLang's, which has `skip_special_tokens` (default true in SGLang) and reads `text`."""

    model: str | None = None
    tokens: list[NonNegInt]
    skip_special_tokens: bool = False


class TokenSamplingParams(_Lenient):
    """`sampling_params` of vLLM's `GenerateRequest`: vLLM's `SamplingParams` fields."""

    n: int = 1
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class GenerateRequest(_Lenient):
    """Body of vLLM's `POST /inference/v1/generate` (tokens in, tokens out)."""

    request_id: str | None = None
    token_ids: list[NonNegInt] = Field(min_length=1)
    sampling_params: TokenSamplingParams
    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    return_token_ids: bool | None = None


class SGLangSamplingParams(_Lenient):
    """`sampling_params` of SGLang's `/generate` (SGLang's `SamplingParams` API fields)."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Seed | None = None


class SGLangGenerateRequest(_Lenient):
    """Body of SGLang's `POST /generate` (`GenerateReqInput`), single requests only."""

    rid: str | None = None
    text: str | None = None
    input_ids: list[NonNegInt] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: str | None = None


class AbortRequest(_Lenient):
    """Body of SGLang's `POST /abort_request` (`AbortReq`)."""

    rid: str = ""
    abort_all: bool = False


class AbortRequestsRequest(_Lenient):
    """Body of vLLM's `POST /inference/v1/abort_requests`."""

    request_ids: list[str]


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
    """A tool definition as vLLM hands it to the chat template (`routing.chat.template_tool`)."""
    return template_tool(tool)
