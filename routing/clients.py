"""The interface every inference client offers, the factory that picks one, and chat rendering.

Three clients speak to three HTTP APIs with the same async interface (`InferenceClient`):

- `routing.vllm.VLLMClient`: vLLM's OpenAI-compatible `/v1/completions` (token-id prompts,
  `return_token_ids`);
- `routing.generate.VLLMGenerateClient`: vLLM's tokens-in/tokens-out `/inference/v1/generate`;
- `routing.sglang.SGLangClient`: SGLang's native `/generate`.

Each returns a `routing.vllm.Completion` whose `finish_reason` follows one convention:
`"stop"` (EOS, stop token or stop string), `"length"` (max_tokens or context) or `"abort"`.

`template_messages` and `template_tool` put chat messages and tool definitions in the shape
vLLM hands them to a chat template, so that a conversation rendered locally (the SGLang
client, whose server cannot render messages) gets the same ids as one rendered by vLLM's
`/tokenize` (and the development server, which uses them too).
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from routing.vllm import Completion

CLIENT_KINDS = ("vllm", "sglang")
VLLM_APIS = ("completions", "generate")


@runtime_checkable
class InferenceClient(Protocol):
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


def make_client(
    kind: str,
    api: str,
    url: str,
    model: str,
    *,
    timeout: float,
    retries: int,
    tokenizer: str | None = None,
) -> InferenceClient:
    """The client for a backend of `kind` ("vllm" or "sglang") speaking `api`.

    For vLLM, `api` "completions" gives `VLLMClient` and "generate" `VLLMGenerateClient`;
    SGLang has one native API, so `api` is not consulted. `tokenizer` (a local path or hub
    name) is what the SGLang client renders chat messages with; it defaults to `model`.
    """
    if kind == "vllm":
        if api == "completions":
            from routing.vllm import VLLMClient

            return VLLMClient(url, model, timeout=timeout, retries=retries)
        if api == "generate":
            from routing.generate import VLLMGenerateClient

            return VLLMGenerateClient(url, model, timeout=timeout, retries=retries)
        raise ValueError(f"unknown vLLM api {api!r}: expected one of {', '.join(VLLM_APIS)}")
    if kind == "sglang":
        from routing.sglang import SGLangClient

        return SGLangClient(url, model, timeout=timeout, retries=retries, tokenizer=tokenizer)
    raise ValueError(f"unknown backend kind {kind!r}: expected one of {', '.join(CLIENT_KINDS)}")


# ----------------------------------------------------------------------------- chat rendering


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template.

    Text parts of list contents are joined with newlines, and JSON-string tool call arguments
    are parsed into objects (templates render them with `tojson`). Raises ValueError for
    arguments that are not valid JSON.
    """
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            m["content"] = "\n".join(t for t in texts if isinstance(t, str))
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if not args:
                    function["arguments"] = {}
                elif isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"tool call arguments are not valid JSON: {e}") from e
                call["function"] = function
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
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
