"""Async clients of inference servers, token ids in and out; vLLM's `/v1/completions` here.

Completions are requested with a prompt of token ids and come back as the exact generated ids
with the logprob of each: nothing is re-tokenized on the way. `HTTPBackend` is the transport
every client shares (`VLLMClient` here, `routing.vllm_generate.VLLMGenerateClient` for
vLLM's `/inference/v1/generate`, `routing.sglang.SGLangClient` for SGLang's native `/generate`):
connection errors and 5xx answers are retried with capped exponential backoff and jitter
(tenacity); a 4xx is the caller's mistake and fails at once (one refusing a prompt id outside
the vocabulary as `OutOfVocabularyError`, whose bound the client remembers); a timeout is not
retried.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Self

import aiohttp
import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from routing.protocol import Completion, normalize_finish_reason

KEEPALIVE_SECONDS = 4.0
"""How long an idle connection is kept for the next request: under the 5 s after which
uvicorn (vLLM's and SGLang's HTTP server) closes it, so a request never goes out on a
connection the server is closing."""
CONNECT_SECONDS = 10.0
MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest answer body read from a backend; a bigger one is a failed request, not memory
spent (a model call's answer, logprobs included, is a few megabytes at most)."""

CONNECTION_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
"""The limits of the httpx client kept for side requests (health, abort): a process may
have many of them in flight at once, which httpx's default of 100 connections would queue."""


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


def bearer(token: str | None) -> dict[str, str]:
    """The `Authorization` header carrying `token` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _check_length(length: int | str | None, url: str) -> None:
    """Refuse an answer longer than `MAX_REPLY_BYTES` (a declared length, or what was read)."""
    try:
        size = int(length) if length is not None else 0
    except ValueError:
        return
    if size > MAX_REPLY_BYTES:
        raise BackendError(f"the answer is longer than {MAX_REPLY_BYTES} bytes", url=url)


class OutOfVocabularyError(BackendError):
    """The server refused a prompt holding an id its vocabulary does not define.

    vLLM says `Token id N is out of vocabulary` (the development server adds `(size V)`),
    SGLang `... contains values greater than the vocab size (V)`. This is what a prompt
    carrying an id the model generated but its tokenizer lacks gets (a model whose output
    layer is padded past its tokenizer): the request's fault, not the server's.
    """

    def __init__(
        self,
        message: str,
        *,
        token_id: int | None,
        vocab_size: int | None,
        status: int | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message, status=status, url=url)
        self.token_id = token_id
        """The refused id the server named, if it named one."""
        self.vocab_size = vocab_size
        """The vocabulary size the server named, if it named one."""

    @property
    def refused_from(self) -> int | None:
        """The smallest id known to be refused: every id at or above it is outside the
        vocabulary (the named size, else the named id)."""
        return self.vocab_size if self.vocab_size is not None else self.token_id


_OUT_OF_VOCABULARY = (
    re.compile(r"[Tt]oken id (?P<id>\d+) is out of vocabulary(?: \(size (?P<size>\d+)\))?"),
    re.compile(r"greater than the vocab size \((?P<size>\d+)\)"),
)


def out_of_vocabulary(error: BackendError) -> OutOfVocabularyError | None:
    """`error` as an `OutOfVocabularyError` when it is a 4xx naming an out-of-vocabulary id
    or the vocabulary size, else None."""
    if isinstance(error, OutOfVocabularyError):
        return error
    if error.status is None or not 400 <= error.status < 500:
        return None
    for pattern in _OUT_OF_VOCABULARY:
        match = pattern.search(error.message)
        if match is not None:
            found = match.groupdict()
            return OutOfVocabularyError(
                error.message,
                token_id=int(found["id"]) if found.get("id") else None,
                vocab_size=int(found["size"]) if found.get("size") else None,
                status=error.status,
                url=error.url,
            )
    return None


def _error_message(response: httpx.Response) -> str:
    return _error_text(response.content, response.reason_phrase)


def _error_text(content: bytes, reason: str) -> str:
    """The message of a server's error answer (its body; `reason` when it has none)."""
    # vLLM: {"error": {"message": ...}}; older vLLM: {"message": ...}; FastAPI: {"detail": ...}.
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode(errors="replace").strip()[:500] or reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


class _Retryable(Exception):
    """A failed attempt that may succeed if repeated (no answer, or a 5xx)."""

    def __init__(self, error: BackendError) -> None:
        super().__init__(str(error))
        self.error = error


class HTTPBackend:
    """The transport the inference clients share: JSON requests to one server, with retries.

    `retries` is how many times a request is repeated after a connection error or a 5xx
    answer (so at most `retries + 1` attempts), waiting `backoff`, `2 * backoff`, ... seconds
    plus up to `backoff` of random jitter, capped at `max_backoff`, in between. Timeouts are
    not retried: the server may still be working on the request. Pass `http` to share a
    connection pool; it is then not closed by `aclose`.
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
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._auth = bearer(api_key)
        """Sent with every request (the server's `--api-key`)."""
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=CONNECT_SECONDS),
            limits=CONNECTION_LIMITS,
            headers=self._auth,
        )
        """For side requests (health, abort), and for every request when passed in."""
        self._session: aiohttp.ClientSession | None = None
        """The requests' connection pool when none was passed in (made on first use, on the
        event loop that uses it): aiohttp costs a tenth of httpx's CPU per request, which is
        most of a many-jobs RUN worker's work."""
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._max_model_len: int | None = None
        """The server's context length once asked (see `max_model_len`)."""
        self.refused_from: int | None = None
        """The smallest id the server is known to refuse in a prompt (every id from it on is
        outside its vocabulary), learnt from its out-of-vocabulary answers; None until one."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pools (unless the pool was passed in)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
        if self._owns_http:
            await self._http.aclose()

    def discard(self) -> None:
        """Drop the connections without awaiting anything, for a client whose event loop is
        going away (the loop is not run again to close them; they are marked closed, so no
        'unclosed session' is reported when they are collected)."""
        session, self._session = self._session, None
        connector = None if session is None else session.connector
        if connector is not None and not connector.closed:
            connector._close()  # the synchronous part of close(): transports closed, no task

    def _pool(self) -> aiohttp.ClientSession:
        """The connection pool of this event loop (a new one on another loop)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
                timeout=aiohttp.ClientTimeout(sock_read=self.timeout, connect=CONNECT_SECONDS),
            )
            self._session_loop = loop
        return self._session

    async def _send(
        self, method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str] | None
    ) -> tuple[int, bytes, str]:
        """One request: the answer's status, body (at most `MAX_REPLY_BYTES`, or
        `BackendError`) and reason phrase."""
        if self._auth:
            headers = {**self._auth, **(headers or {})}
        if not self._owns_http:
            async with self._http.stream(
                method, url, json=body, headers=headers, timeout=self.timeout
            ) as response:
                _check_length(response.headers.get("content-length"), url)
                content = bytearray()
                async for chunk in response.aiter_bytes():
                    content += chunk
                    _check_length(len(content), url)
                return response.status_code, bytes(content), response.reason_phrase
        # Redirects are not followed (as httpx does not): a backend is reached only at the
        # address it was registered and checked with.
        pool = self._pool()
        async with pool.request(
            method, url, json=body, headers=headers, allow_redirects=False
        ) as answer:
            if answer.content_length is not None:
                _check_length(answer.content_length, url)
                return answer.status, await answer.read(), answer.reason or ""
            data = bytearray()  # no length given (chunked): read up to the bound
            async for chunk in answer.content.iter_chunked(1 << 16):
                data += chunk
                _check_length(len(data), url)
            return answer.status, bytes(data), answer.reason or ""

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """The JSON answer to one request, retried as the class says; raises BackendError."""
        url = f"{self.base_url}{path}"
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(
                initial=self.backoff, max=self.max_backoff, jitter=self.backoff
            ),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        attempts = 0
        try:
            async for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    return await self._attempt(method, url, body, headers)
        except _Retryable as e:
            error = e.error
            if attempts > 1:
                raise BackendError(
                    f"{error.message} (after {attempts} attempts)", status=error.status, url=url
                ) from e.__cause__
            raise error from e.__cause__
        raise AssertionError("unreachable: tenacity ends with an answer or an error")

    async def _attempt(
        self, method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str] | None
    ) -> Any:
        try:
            status, content, reason = await self._send(method, url, body, headers)
        except (httpx.TimeoutException, TimeoutError) as e:
            raise BackendError(
                f"no answer within {self.timeout:g}s ({type(e).__name__})", url=url
            ) from e
        except (httpx.TransportError, aiohttp.ClientError) as e:
            raise _Retryable(BackendError(f"{type(e).__name__}: {e}", url=url)) from e
        if status < 400:
            try:
                return json.loads(content) if content else None
            except ValueError as e:
                raise BackendError(
                    f"answer is not JSON: {content[:200].decode(errors='replace')!r}",
                    status=status,
                    url=url,
                ) from e
        error = BackendError(_error_text(content, reason), status=status, url=url)
        if error.retryable:
            raise _Retryable(error)
        refused = out_of_vocabulary(error)
        if refused is not None:
            self._learn_refused(refused)
            raise refused
        raise error

    def _learn_refused(self, error: OutOfVocabularyError) -> None:
        bound = error.refused_from
        if bound is not None and (self.refused_from is None or bound < self.refused_from):
            self.refused_from = bound

    def first_refused(self, ids: list[int]) -> int | None:
        """The first of `ids` the server is known to refuse in a prompt, if any."""
        bound = self.refused_from
        if bound is None:
            return None
        return next((i for i in ids if i >= bound), None)

    async def _post(
        self, path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        return self._object(await self._request("POST", path, body, headers=headers), path)

    async def _get(self, path: str) -> dict[str, Any]:
        return self._object(await self._request("GET", path), path)

    def _object(self, data: Any, path: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise BackendError(
                f"expected a JSON object, got {data!r:.200}", url=self.base_url + path
            )
        return data

    async def max_model_len(self) -> int:
        """The server's context length."""
        raise NotImplementedError

    async def _fit(self, prompt_ids: list[int], max_tokens: int) -> int:
        """`max_tokens` lowered to what the context leaves after the prompt (kept as given
        when the context length cannot be asked, or when the prompt fills the context)."""
        try:
            room = await self.max_model_len() - len(prompt_ids)
        except BackendError as e:
            if e.retryable:
                raise
            return max_tokens  # the server cannot say: send max_tokens as given
        return min(max_tokens, room) if room >= 1 else max_tokens

    async def health(self) -> bool:
        """Whether `GET /health` answers 200 (one attempt, at most 5 s)."""
        try:
            response = await self._http.get(
                f"{self.base_url}/health", timeout=5.0, headers=self._auth
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def request_id_header(request_id: str | None) -> dict[str, str] | None:
    """vLLM's `X-Request-Id` header, which takes precedence over a body's `request_id`."""
    return None if request_id is None else {"X-Request-Id": request_id}


class VLLMClient(HTTPBackend):
    """Client of one inference server speaking vLLM's OpenAI-compatible HTTP API.

    Completions go through `/v1/completions` with a prompt of token ids and
    `return_token_ids`; tokenization through `/tokenize` and `/detokenize`. Retries and
    errors: see `HTTPBackend`.
    """

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

        Special tokens are kept in the text, and a matched stop string stays in the output (and
        its ids in `output_ids`), so the ids always follow the prompt without a gap. With
        `fit_context`, `max_tokens` is lowered to what the context leaves after the prompt
        (vLLM refuses prompt + max_tokens > max_model_len); a prompt that fills the context
        is still sent, and the server's 400 is raised as a BackendError.

        `cache_salt` is sent as vLLM's `cache_salt`: prefix-cache entries made under one salt
        are not reused under another (or none). `request_id` is sent as the body's
        `request_id` and the `X-Request-Id` header (vLLM names the request `cmpl-<id>`).
        """
        if fit_context:
            max_tokens = await self._fit(prompt_ids, max_tokens)
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
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if request_id is not None:
            body["request_id"] = request_id
        data = await self._post("/v1/completions", body, headers=request_id_header(request_id))
        return self._completion(data, prompt_ids)

    async def abort(self, request_id: str) -> None:
        """Nothing to send: vLLM's OpenAI server has no abort route.

        vLLM aborts a request when its HTTP connection closes, so cancelling the asyncio task
        that awaits `complete` is the abort (the server counts it as
        `vllm:request_success_total{finished_reason="abort"}` where it records aborts).
        """

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
            finish_reason=normalize_finish_reason(choice.get("finish_reason")),
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
