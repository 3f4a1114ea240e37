"""The factory that picks the inference client for a backend.

Three clients speak to three HTTP APIs with the same async interface
(`routing.protocol.InferenceClient`):

- `routing.vllm.VLLMClient`: vLLM's OpenAI-compatible `/v1/completions` (token-id prompts,
  `return_token_ids`);
- `routing.vllm_generate.VLLMGenerateClient`: vLLM's tokens-in/tokens-out
  `/inference/v1/generate`;
- `routing.sglang.SGLangClient`: SGLang's native `/generate`.

Each returns a `routing.protocol.Completion` whose `finish_reason` follows one convention:
`"stop"` (EOS, stop token or stop string), `"length"` (max_tokens or context) or `"abort"`.
"""

from __future__ import annotations

from routing.protocol import InferenceClient
from routing.sglang import SGLangClient
from routing.vllm import VLLMClient
from routing.vllm_generate import VLLMGenerateClient

CLIENT_KINDS = ("vllm", "sglang")
VLLM_APIS = ("completions", "generate")


def make_client(
    kind: str,
    api: str,
    url: str,
    model: str,
    *,
    timeout: float,
    retries: int,
    tokenizer: str | None = None,
    api_key: str | None = None,
) -> InferenceClient:
    """The client for a backend of `kind` ("vllm" or "sglang") speaking `api`.

    For vLLM, `api` "completions" gives `VLLMClient` and "generate" `VLLMGenerateClient`;
    SGLang has one native API, so `api` is not consulted. `tokenizer` (a local path or hub
    name) is what the SGLang client renders chat messages with; it defaults to `model`.
    `api_key` is sent as a bearer token with every request.
    """
    if kind == "vllm":
        if api == "completions":
            return VLLMClient(url, model, timeout=timeout, retries=retries, api_key=api_key)
        if api == "generate":
            return VLLMGenerateClient(url, model, timeout=timeout, retries=retries, api_key=api_key)
        raise ValueError(f"unknown vLLM api {api!r}: expected one of {', '.join(VLLM_APIS)}")
    if kind == "sglang":
        return SGLangClient(
            url, model, timeout=timeout, retries=retries, tokenizer=tokenizer, api_key=api_key
        )
    raise ValueError(f"unknown backend kind {kind!r}: expected one of {', '.join(CLIENT_KINDS)}")
