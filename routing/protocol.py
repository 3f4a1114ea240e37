"""The inference client interface: what a completion is and what a client offers.

Every client (`routing.vllm.VLLMClient`, `routing.vllm_generate.VLLMGenerateClient`,
`routing.sglang.SGLangClient`) returns a `Completion` whose `finish_reason` follows one
convention (`FINISH_REASONS`), and offers `InferenceClient`. The agent loop asks less of its
policy (`PolicyClient`: generation and the context length), so anything that routes calls to
clients can stand in for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "abort")
"""The one convention of `Completion.finish_reason` across clients."""


def normalize_finish_reason(reason: str | None) -> str | None:
    """A backend's finish reason in the clients' convention.

    `"stop"`: EOS, a stop token or a stop string; `"length"`: `max_tokens` or the context;
    `"abort"`: aborted by the server or by us. vLLM's opt-in repetition detection
    (`"repetition"`) ends a turn early like a stop; any other value is passed through as is.
    """
    if reason is None:
        return None
    value = str(reason).lower()
    if value == "repetition":
        return "stop"
    return value


@dataclass
class Completion:
    """One generated continuation of a prompt of token ids."""

    output_ids: list[int]
    logprobs: list[float]
    """One per output id: the logprob of the sampled id (as the backend reports it)."""
    text: str
    finish_reason: str | None
    """`"stop"` (EOS, stop token or stop string), `"length"` (max_tokens or context) or
    `"abort"` (aborted by the server or by us), whichever backend answered."""
    stop_reason: int | str | None
    """The stop string or stop token id that ended generation; None for length (and for EOS
    on vLLM; SGLang names the EOS id it matched)."""
    prompt_tokens: int
    backend_id: str | None = None
    """The backend that generated it (set by the job's router)."""
    policy_version: int | None = None
    """The weights it was generated with, as that backend announced them."""


class PolicyClient(Protocol):
    """What the agent loop needs of its policy: generation after token ids, the context length."""

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Completion:
        """Generate after `prompt_ids`: the exact generated ids, one logprob each."""
        ...

    async def max_model_len(self) -> int:
        """The context length of the model behind it."""
        ...


@runtime_checkable
class KnowsRefusedIds(Protocol):
    """A policy client that may know which ids its backend refuses in a prompt (optional)."""

    def first_refused(self, ids: list[int]) -> int | None:
        """The first of `ids` the backend is known to refuse in a prompt, if any."""
        ...


@runtime_checkable
class InferenceClient(PolicyClient, Protocol):
    """What the worker needs of an inference server: token ids in and out, and its tokenizer."""

    base_url: str
    model: str

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        fit_context: bool = True,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Generate after `prompt_ids`: the exact generated ids, one logprob each."""
        ...

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of `messages` rendered by the served model's chat template."""
        ...

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of plain `text`."""
        ...

    async def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        ...

    async def max_model_len(self) -> int:
        """The server's context length."""
        ...

    async def health(self) -> bool:
        """Whether the server answers its health check."""
        ...

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop the request named `request_id` (best effort)."""
        ...

    async def aclose(self) -> None:
        """Release the connection pool."""
        ...
