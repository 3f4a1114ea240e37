"""Async client of a vLLM server (or anything speaking its HTTP API), token ids in and out.

Completions are requested with a prompt of token ids and come back as the exact generated ids
with the logprob of each: nothing is re-tokenized on the way. Connection errors and 5xx answers
are retried with exponential backoff; a 4xx is the caller's mistake and fails at once.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Completion:
    """One generated continuation of a prompt of token ids."""

    output_ids: list[int]
    logprobs: list[float]
    """One per output id: the logprob of the sampled id (as the backend reports it)."""
    text: str
    finish_reason: str | None
    """`"stop"` (EOS, stop token or stop string), `"length"` (max_tokens or context), ..."""
    stop_reason: int | str | None
    """The stop string or stop token id that ended generation; None for EOS or length."""
    prompt_tokens: int


class BackendError(Exception):
    """An inference server failed or refused a request.

    `status` is the HTTP status (None when no answer came: connection refused, timeout, bad
    body); `message` is the server's own error text where it gave one; `url` is the request's.
    """

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None) -> None:
        self.message = message
        self.status = status
        self.url = url
        where = f"{url}: " if url else ""
        code = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"{where}{code}{message}")

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later (no answer, or a 5xx)."""
        return self.status is None or self.status >= 500


def _error_message(response: httpx.Response) -> str:
    # vLLM: {"error": {"message": ...}}; older vLLM: {"message": ...}; FastAPI: {"detail": ...}.
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


class VLLMClient:
    """Client of one inference server speaking vLLM's OpenAI-compatible HTTP API.

    `retries` is how many times a request is repeated after a connection error or a 5xx
    answer (so at most `retries + 1` attempts), waiting `backoff`, `2 * backoff`, ... seconds
    (capped at 10 s, with jitter) in between. Timeouts are not retried: the server may still
    be working on the request. Pass `http` to share a connection pool; it is then not closed
    by `aclose`.
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
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff = backoff
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
        self._max_model_len: int | None = None

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (unless it was passed in)."""
        if self._owns_http:
            await self._http.aclose()

    # ----------------------------------------------------------------------------- transport

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, url, json=body, timeout=self.timeout)
            except httpx.TimeoutException as e:
                raise BackendError(
                    f"no answer within {self.timeout:g}s ({type(e).__name__})", url=url
                ) from e
            except httpx.TransportError as e:
                error = BackendError(f"{type(e).__name__}: {e}", url=url)
            else:
                if response.status_code < 400:
                    try:
                        return response.json() if response.content else None
                    except ValueError as e:
                        raise BackendError(
                            f"answer is not JSON: {response.text[:200]!r}",
                            status=response.status_code,
                            url=url,
                        ) from e
                error = BackendError(_error_message(response), status=response.status_code, url=url)
            if not error.retryable or attempt >= self.retries:
                if attempt:
                    raise BackendError(
                        f"{error.message} (after {attempt + 1} attempts)",
                        status=error.status,
                        url=url,
                    )
                raise error
            delay = min(10.0, self.backoff * 2**attempt) * (0.5 + random.random() / 2)
            attempt += 1
            await asyncio.sleep(delay)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = await self._request("POST", path, body)
        if not isinstance(data, dict):
            raise BackendError(
                f"expected a JSON object, got {data!r:.200}", url=self.base_url + path
            )
        return data

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
    ) -> Completion:
        """Generate after `prompt_ids` and return the exact generated ids and their logprobs.

        Special tokens are kept in the text, and a matched stop string stays in the output (and
        its ids in `output_ids`), so the ids always follow the prompt without a gap. With
        `fit_context`, `max_tokens` is lowered to what the context leaves after the prompt
        (vLLM refuses prompt + max_tokens > max_model_len); a prompt that fills the context
        is still sent, and the server's 400 is raised as a BackendError.
        """
        if fit_context:
            try:
                room = await self.max_model_len() - len(prompt_ids)
            except BackendError as e:
                if e.retryable:
                    raise
                room = 0  # no /tokenize here: send max_tokens as given
            if room >= 1:
                max_tokens = min(max_tokens, room)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = list(stop)
        data = await self._post("/v1/completions", body)
        return self._completion(data, prompt_ids)

    def _completion(self, data: dict[str, Any], prompt_ids: list[int]) -> Completion:
        url = f"{self.base_url}/v1/completions"
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise BackendError(f"answer has no choices: {data!r:.300}", url=url) from e
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise BackendError(
                "answer has no choices[0].token_ids: the server must support "
                "`return_token_ids` (vLLM >= 0.10.2)",
                url=url,
            )
        echoed = choice.get("prompt_token_ids", data.get("prompt_token_ids"))
        if isinstance(echoed, list) and echoed != prompt_ids:
            raise BackendError(
                f"the server changed the prompt ids ({len(prompt_ids)} sent, {len(echoed)} echoed)",
                url=url,
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            count = len(logprobs) if isinstance(logprobs, list) else "no"
            raise BackendError(
                f"answer has {count} token_logprobs for {len(ids)} token_ids", url=url
            )
        if any(lp is None for lp in logprobs):
            raise BackendError("answer has null token_logprobs", url=url)
        usage = data.get("usage") or {}
        return Completion(
            output_ids=[int(i) for i in ids],
            logprobs=[float(lp) for lp in logprobs],
            text=str(choice.get("text") or ""),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=int(usage.get("prompt_tokens", len(prompt_ids))),
        )

    # ----------------------------------------------------------------------------- tokenization

    def _remember(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("max_model_len"), int):
            self._max_model_len = data["max_model_len"]

    def _tokens(self, data: dict[str, Any], path: str) -> list[int]:
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise BackendError(f"answer has no tokens: {data!r:.200}", url=self.base_url + path)
        self._remember(data)
        return [int(t) for t in tokens]

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of `messages` rendered by the served model's own chat template."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "add_special_tokens": False,
        }
        if tools:
            body["tools"] = tools
        return self._tokens(await self._post("/tokenize", body), "/tokenize")

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of plain `text`, by the served model's tokenizer."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        return self._tokens(await self._post("/tokenize", body), "/tokenize")

    async def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        data = await self._post("/detokenize", {"model": self.model, "tokens": ids})
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise BackendError(f"answer has no prompt: {data!r:.200}", url=self.base_url)
        return prompt

    async def max_model_len(self) -> int:
        """The server's context length (asked once via `/tokenize`, then remembered)."""
        if self._max_model_len is None:
            await self.tokenize(" ")
        if self._max_model_len is None:
            raise BackendError("/tokenize answer has no max_model_len", url=self.base_url)
        return self._max_model_len

    async def health(self) -> bool:
        """Whether `GET /health` answers 200 (one attempt, at most 5 s)."""
        try:
            response = await self._http.get(f"{self.base_url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
