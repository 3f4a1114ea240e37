"""Client of vLLM's tokens-in/tokens-out endpoint, `POST /inference/v1/generate`.

The request and answer follow vLLM's `GenerateRequest` / `GenerateResponse`
(vllm-project/vllm, `vllm/entrypoints/serve/disagg/protocol.py`, served by
`vllm/entrypoints/serve/disagg/api_router.py` and `serving.py`; in vLLM 0.32 they live in
`vllm/entrypoints/scale_out/token_in_token_out/`):

    request  {"model", "token_ids", "sampling_params": {...vLLM SamplingParams...},
              "stream": false, "return_token_ids": true, "request_id"?, "cache_salt"?}
    answer   {"request_id", "choices": [{"index", "token_ids", "finish_reason",
              "logprobs": {"content": [{"token_id" | "token": "token_id:<id>", "logprob",
              ...}]}}], "prompt_token_ids", "usage"?: {"prompt_tokens", ...}, ...}

With `return_token_ids` the answer echoes the prompt as the engine received it
(`prompt_token_ids`), which is checked against the ids sent. A cancelled request is aborted
twice over: its connection closes (the route is wrapped in vLLM's `with_cancellation`) and
`POST /inference/v1/abort_requests` names it, with the `generate-tokens-` prefix vLLM gives
every request of this route (a bare id silently aborts nothing).

The answer has no text and no `stop_reason`: the text is asked of `/detokenize` (one more
request, special tokens kept), and the stop string is recovered from it. Tokenization, context
length and health are vLLM's as in `VLLMClient`.
"""

from __future__ import annotations

from typing import Any

import httpx

from routing.protocol import Completion, normalize_finish_reason
from routing.vllm import (
    BackendError,
    OutOfVocabularyError,
    VLLMClient,
    _error_message,
    request_id_header,
)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
REQUEST_PREFIX = "generate-tokens-"
"""What vLLM puts before the id of every request of `/inference/v1/generate`."""
ABORT_TIMEOUT = 5.0
"""Seconds an abort may take (one attempt: the request's connection is closed anyway)."""


def matched_stop(text: str, stop: list[str] | None) -> str | None:
    """The stop string that ended `text` (kept in it), if one did.

    Generation stops at the first completed stop string, so the one completed last in the
    text is the one that stopped it.
    """
    best: tuple[int, str] | None = None
    for s in stop or []:
        index = text.rfind(s)
        if index >= 0 and (best is None or index + len(s) > best[0]):
            best = (index + len(s), s)
    return None if best is None else best[1]


class VLLMGenerateClient(VLLMClient):
    """Client of a vLLM server's `POST /inference/v1/generate` (tokens in, tokens out).

    Same interface and transport as `VLLMClient`. Abort: vLLM aborts a request whose
    connection closes (the route is wrapped in `with_cancellation`), so cancelling the
    awaiting task aborts it; `abort` also names it to `/inference/v1/abort_requests` (served
    with the route itself, under `--enable-scale-out`).
    """

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

        Sampling parameters are those of `VLLMClient.complete` (special tokens kept, stop
        strings included in the output), sent inside `sampling_params`. `cache_salt` and
        `request_id` are top-level fields of the request (and `request_id` also the
        `X-Request-Id` header; vLLM names the request `generate-tokens-<id>`).
        """
        if fit_context:
            max_tokens = await self._fit(prompt_ids, max_tokens)
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if seed is not None:
            sampling["seed"] = seed
        if stop:
            sampling["stop"] = list(stop)
        body: dict[str, Any] = {
            "model": self.model,
            "token_ids": prompt_ids,
            "sampling_params": sampling,
            "stream": False,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if request_id is not None:
            body["request_id"] = request_id
        data = await self._post(GENERATE_PATH, body, headers=request_id_header(request_id))
        ids, logprobs, reason, prompt_tokens = self._generated(data, prompt_ids)
        text = await self._text_of(ids)
        return Completion(
            output_ids=ids,
            logprobs=logprobs,
            text=text,
            finish_reason=reason,
            stop_reason=matched_stop(text, stop) if reason == "stop" else None,
            prompt_tokens=prompt_tokens,
        )

    async def abort(self, request_id: str) -> None:
        """Abort the request sent with `request_id` through `/inference/v1/abort_requests`,
        as vLLM names it (`generate-tokens-<id>`); one attempt. vLLM answers 200 whether or
        not such a request runs. Raises `BackendError` when the server does not accept it."""
        url = f"{self.base_url}{ABORT_PATH}"
        body = {"request_ids": [f"{REQUEST_PREFIX}{request_id}"]}
        try:
            response = await self._http.post(
                url, json=body, timeout=ABORT_TIMEOUT, headers=self._auth
            )
        except httpx.HTTPError as e:
            raise BackendError(f"abort: {type(e).__name__}: {e}", url=url) from e
        if response.status_code >= 400:
            raise BackendError(_error_message(response), status=response.status_code, url=url)

    async def _text_of(self, ids: list[int]) -> str:
        """The text of generated `ids` by `/detokenize`. Ids the server refuses as outside its
        vocabulary (a model padded past its tokenizer can generate them) decode to nothing,
        as a tokenizer decodes them: they are left out and the rest is asked again."""
        kept = ids
        while kept:
            try:
                return await self.detokenize(kept)
            except OutOfVocabularyError as e:
                bound = e.refused_from
                fewer = [i for i in kept if bound is None or i < bound]
                if len(fewer) == len(kept):
                    raise
                kept = fewer
        return ""

    def _generated(
        self, data: dict[str, Any], prompt_ids: list[int]
    ) -> tuple[list[int], list[float], str | None, int]:
        url = f"{self.base_url}{GENERATE_PATH}"
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise BackendError(f"answer has no choices: {data!r:.300}", url=url) from e
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise BackendError(f"answer has no choices[0].token_ids: {data!r:.300}", url=url)
        content = (choice.get("logprobs") or {}).get("content")
        if not isinstance(content, list) or len(content) != len(ids):
            count = len(content) if isinstance(content, list) else "no"
            raise BackendError(f"answer has {count} logprobs for {len(ids)} token_ids", url=url)
        logprobs: list[float] = []
        for token_id, entry in zip(ids, content, strict=True):
            logprob = entry.get("logprob") if isinstance(entry, dict) else None
            if logprob is None:
                raise BackendError("answer has a null logprob", url=url)
            # vLLM 0.32 names the id (`token_id`), earlier ones spelled it (`token`).
            token = entry.get("token")
            expected = f"token_id:{token_id}"
            named = entry.get("token_id")
            if (isinstance(token, str) and token.startswith("token_id:") and token != expected) or (
                isinstance(named, int) and named != token_id
            ):
                raise BackendError(
                    f"logprob entry {token or named!r} does not match token id {token_id}",
                    url=url,
                )
            logprobs.append(float(logprob))
        echoed = data.get("prompt_token_ids")
        if isinstance(echoed, list) and echoed != prompt_ids:
            raise BackendError(
                f"the server changed the prompt ids ({len(prompt_ids)} sent, {len(echoed)} echoed)",
                url=url,
            )
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or len(prompt_ids))
        reason = normalize_finish_reason(choice.get("finish_reason"))
        return [int(i) for i in ids], logprobs, reason, prompt_tokens
