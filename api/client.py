"""The Python client of the rollserve gateway, for trainers: sync and async, same methods.

    from api.client import RolloutClient
    from core.flatten import sequences

    with RolloutClient() as client:                 # ROLLSERVE_URL, ROLLSERVE_API_TOKEN
        batch = client.submit_batch(tasks, group_size=8, sampling={"temperature": 1.0})
        for trajectory in client.iter_batch_results(batch.batch_id):
            for part in sequences(trajectory):      # one per segment
                ...  # part.prompt_ids, .response_ids, .loss_mask, .logprobs; trajectory.reward

A trajectory is one trainable sequence, or several when a harness edited its history
(`Trajectory.segments`): `core.flatten.sequences` gives them all, each with the job's reward.
Every answer is parsed into the models of `core.schemas`. Every failure, an HTTP error status
or an unreachable gateway, is raised as `RolloutServiceError`; a results stream that breaks is
first resumed after its last line, for up to `resume_for` seconds (see `api.resume`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from api.client_sessions import AsyncSessions, Sessions
from api.client_weights import AsyncWeightUpdates, WeightUpdates
from api.resume import RESUME_SECONDS, ResultLine, Resume
from core.schemas import (
    AgentParams,
    Backend,
    BatchAccepted,
    BatchProgress,
    Health,
    SamplingParams,
    Stats,
    Task,
    Trajectory,
)

DEFAULT_URL = "http://127.0.0.1:8600"

M = TypeVar("M", bound=BaseModel)

SamplingLike = Mapping[str, Any] | SamplingParams | None
AgentLike = Mapping[str, Any] | AgentParams | None
TaskLike = Mapping[str, Any] | Task
DynamicLike = Mapping[str, Any] | BaseModel | None
"""`dynamic_sampling` of a batch: `{"target_groups", ...}` or `core.schemas.DynamicSampling`."""


class RolloutServiceError(RuntimeError):
    """The gateway answered with an error status, or could not be reached.

    ``status_code`` is the HTTP status, or None when no answer came (connection refused,
    timeout, a stream cut short). ``detail`` is FastAPI's ``detail`` as sent (a string, or for
    a 422 a list of ``{"loc", "msg", ...}``); ``str(error)`` is a readable one-line message.
    """

    def __init__(self, status_code: int | None, detail: Any, message: str | None = None) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(message or _error_message(status_code, detail))


def format_loc(loc: Any) -> str:
    """A pydantic error location as a dotted field path, without FastAPI's ``body`` prefix."""
    if isinstance(loc, str):
        return loc
    if not isinstance(loc, Sequence):
        return str(loc)
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts)


def detail_items(detail: Any) -> list[tuple[str, str]]:
    """A 422 ``detail`` as (field path, message) pairs; other details as one ("", text) pair."""
    if isinstance(detail, list):
        items = []
        for entry in detail:
            if isinstance(entry, Mapping):
                items.append((format_loc(entry.get("loc", ())), str(entry.get("msg", entry))))
            else:
                items.append(("", str(entry)))
        return items
    if isinstance(detail, str):
        return [("", detail)]
    return [("", json.dumps(detail, default=str))]


def render_detail(detail: Any) -> str:
    """FastAPI's ``detail`` as text; a validation list becomes ``field.path: msg; ...``."""
    return "; ".join(f"{path}: {msg}" if path else msg for path, msg in detail_items(detail))


def _error_message(status_code: int | None, detail: Any) -> str:
    text = render_detail(detail)
    if status_code is None:
        return text
    if status_code == 401:
        hint = " (set ROLLSERVE_API_TOKEN to the gateway's token)"
        return f"HTTP 401: {text}{hint}"
    return f"HTTP {status_code}: {text}"


def _error_from_response(response: httpx.Response) -> RolloutServiceError:
    """The error for a non-2xx answer; the body must have been read."""
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, Mapping) and "detail" in body:
        detail = body["detail"]
    elif response.text:
        detail = response.text.strip()
    else:
        detail = response.reason_phrase or "error"
    return RolloutServiceError(response.status_code, detail)


def _transport_error(url: str, exc: httpx.TransportError) -> RolloutServiceError:
    if isinstance(exc, httpx.ConnectError):
        message = (
            f"the rollserve gateway at {url} is not reachable ({exc or 'connection refused'}); "
            "start one with `rollserve up`, or point ROLLSERVE_URL (or --url) at a running gateway"
        )
    elif isinstance(exc, httpx.TimeoutException):
        message = f"no answer from the rollserve gateway at {url} in time ({type(exc).__name__})"
    else:
        message = f"talking to the rollserve gateway at {url} failed: {type(exc).__name__}: {exc}"
    return RolloutServiceError(None, message, message)


def _dump(value: BaseModel | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A request part as JSON-ready data; dicts pass through for the server to validate."""
    if value is None:
        return None
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    return dict(value)


def _parse(model: type[M], response: httpx.Response) -> M:
    try:
        return model.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise RolloutServiceError(
            response.status_code,
            f"unexpected answer from {response.request.url.path}: {exc}",
        ) from exc


def _parse_backends(response: httpx.Response) -> list[Backend]:
    data = response.json()
    # A bare list, or an object wrapping it; both are accepted.
    if isinstance(data, Mapping):
        data = data.get("backends", [])
    return [Backend.model_validate(item) for item in data]


def _result_line(line: str, status_code: int) -> ResultLine | None:
    """One NDJSON line of a results stream; None for a keep-alive blank line."""
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise RolloutServiceError(status_code, f"malformed line in results stream: {exc}") from exc
    if isinstance(data, Mapping) and "detail" in data and "job_id" not in data:
        # The server reports a failure that happened after the stream began.
        raise RolloutServiceError(status_code, data["detail"])
    cursor = data.get("cursor") if isinstance(data, Mapping) else None
    return ResultLine(cursor if isinstance(cursor, str) else None, Trajectory.model_validate(data))


def _stream_failure(state: Resume, error: RolloutServiceError) -> RolloutServiceError:
    """What a results stream that cannot go on raises: `error`, or once the time to resume
    ran out, an error that says so and where to go on from."""
    if not state.gave_up:
        return error
    where = f"after={state.cursor!r}" if state.cursor else "from the start"
    message = (
        f"the results stream of batch {state.batch_id} broke off and could not be resumed "
        f"within {state.resume_for:g} s ({error}); call again {where} to go on"
    )
    failure = RolloutServiceError(error.status_code, message, message)
    failure.__cause__ = error
    return failure


def _with_params(body: dict[str, Any], sampling: SamplingLike, agent: AgentLike) -> dict[str, Any]:
    """`body` with the sampling and agent parameters that were given."""
    if sampling is not None:
        body["sampling"] = _dump(sampling)
    if agent is not None:
        body["agent"] = _dump(agent)
    return body


def _rollout_body(task: TaskLike, sampling: SamplingLike, agent: AgentLike) -> dict[str, Any]:
    return _with_params({"task": _dump(task)}, sampling, agent)


def _batch_body(
    tasks: Sequence[TaskLike],
    group_size: int,
    sampling: SamplingLike,
    agent: AgentLike,
    dynamic_sampling: DynamicLike = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"tasks": [_dump(t) for t in tasks], "group_size": group_size}
    if dynamic_sampling is not None:
        body["dynamic_sampling"] = _dump(dynamic_sampling)
    return _with_params(body, sampling, agent)


def _backend_body(
    url: str,
    model: str,
    kind: str,
    id: str | None,
    policy_version: int | None,
    api: str | None = None,
    capacity: float | None = None,
    tokenizer: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"url": url, "model": model, "kind": kind}
    optional = {
        "id": id,
        "policy_version": policy_version,
        "api": api,
        "capacity": capacity,
        "tokenizer": tokenizer,
        "api_key": api_key,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def _drain_path(backend_id: str | None, action: str) -> str:
    """`/v1/backends/{id}/{action}`, or `/v1/backends/{action}` for every backend."""
    if backend_id is None:
        return f"/v1/backends/{action}"
    return f"/v1/backends/{_seg(backend_id)}/{action}"


def _resume_body(policy_version: int | None) -> dict[str, Any]:
    return {} if policy_version is None else {"policy_version": policy_version}


def _backend_or_list(response: httpx.Response) -> Backend | list[Backend]:
    if isinstance(response.json(), list):
        return _parse_backends(response)
    return _parse(Backend, response)


def _wait_params(wait: bool, timeout: float | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if wait:
        params["wait"] = "true"
        if timeout is not None:
            params["timeout"] = repr(float(timeout))
    return params


def _submitted(response: httpx.Response) -> str | Trajectory:
    """202 carries ``{"job_id"}``; 200 carries the finished trajectory (``?wait=true``)."""
    data = response.json()
    if response.status_code == 202 or (isinstance(data, Mapping) and set(data) == {"job_id"}):
        return str(data["job_id"])
    return _parse(Trajectory, response)


def _seg(value: str) -> str:
    return quote(value, safe="")


class _Base:
    def __init__(self, url: str | None, token: str | None, timeout: float) -> None:
        self.url = (url or os.environ.get("ROLLSERVE_URL") or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get("ROLLSERVE_API_TOKEN")
        self.timeout = timeout
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def _wait_timeout(self, wait: bool, timeout: float | None) -> httpx.Timeout:
        if not wait:
            return httpx.Timeout(self.timeout)
        # The server holds the request up to `timeout` (or its own cap when None).
        read = None if timeout is None else float(timeout) + self.timeout
        return httpx.Timeout(self.timeout, read=read)


class RolloutClient(Sessions, WeightUpdates, _Base):
    """Blocking client of the gateway. Use as a context manager, or call ``close()``.

    ``url`` defaults to ``$ROLLSERVE_URL`` (else http://127.0.0.1:8600), ``token`` to
    ``$ROLLSERVE_API_TOKEN``; ``timeout`` is the per-request limit in seconds.
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60.0
    ) -> None:
        super().__init__(url, token, timeout)
        self._http = httpx.Client(
            base_url=self.url, headers=self._headers, timeout=httpx.Timeout(timeout)
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc) from exc
        if response.is_error:
            raise _error_from_response(response)
        return response

    def health(self) -> Health:
        """``GET /healthz``."""
        return _parse(Health, self._request("GET", "/healthz"))

    def stats(self) -> Stats:
        """``GET /v1/stats``: queue depths, busy stages, workers, backends, throughput."""
        return _parse(Stats, self._request("GET", "/v1/stats"))

    def submit_rollout(
        self,
        task: TaskLike,
        sampling: SamplingLike = None,
        agent: AgentLike = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> str | Trajectory:
        """Start one job; returns its id.

        With ``wait=True`` the gateway holds the request until the job finishes (at most
        ``timeout`` seconds, or its own cap) and the finished Trajectory is returned; if the
        job is still running then, its id is returned instead.
        """
        response = self._request(
            "POST",
            "/v1/rollouts",
            json=_rollout_body(task, sampling, agent),
            params=_wait_params(wait, timeout),
            timeout=self._wait_timeout(wait, timeout),
        )
        return _submitted(response)

    def get_rollout(self, job_id: str) -> Trajectory:
        """``GET /v1/rollouts/{job_id}``: the trajectory so far (final once terminal)."""
        return _parse(Trajectory, self._request("GET", f"/v1/rollouts/{_seg(job_id)}"))

    def cancel_rollout(self, job_id: str) -> Trajectory:
        """``DELETE /v1/rollouts/{job_id}``: cancel the job; returns it as it stands."""
        return _parse(Trajectory, self._request("DELETE", f"/v1/rollouts/{_seg(job_id)}"))

    def submit_batch(
        self,
        tasks: Sequence[TaskLike],
        group_size: int = 1,
        sampling: SamplingLike = None,
        agent: AgentLike = None,
        dynamic_sampling: DynamicLike = None,
    ) -> BatchAccepted:
        """``POST /v1/batches``: every task becomes ``group_size`` jobs; returns their ids.

        With ``dynamic_sampling`` the tasks are a pool that groups are drawn from until
        ``target_groups`` informative groups are complete; the ids are the first groups'."""
        body = _batch_body(tasks, group_size, sampling, agent, dynamic_sampling)
        response = self._request("POST", "/v1/batches", json=body)
        return _parse(BatchAccepted, response)

    def batch_progress(self, batch_id: str) -> BatchProgress:
        """``GET /v1/batches/{batch_id}``."""
        return _parse(BatchProgress, self._request("GET", f"/v1/batches/{_seg(batch_id)}"))

    def iter_batch_results(
        self, batch_id: str, after: str | None = None, resume_for: float = RESUME_SECONDS
    ) -> Iterator[Trajectory]:
        """Finished trajectories of the batch as the gateway streams them (NDJSON), each once.

        The iterator ends when the gateway closes the stream (the batch is done). There is no
        read deadline while streaming; blank keep-alive lines are skipped. When the stream
        breaks (the connection drops, the gateway restarts, a 5xx answer), it is reopened
        right after the last line received, with backoff, for up to ``resume_for`` seconds
        per outage; then RolloutServiceError. ``after`` starts after that line's cursor (see
        `iter_batch_lines`)."""
        for item in self.iter_batch_lines(batch_id, after, resume_for):
            yield item.trajectory

    def iter_batch_lines(
        self, batch_id: str, after: str | None = None, resume_for: float = RESUME_SECONDS
    ) -> Iterator[ResultLine]:
        """`iter_batch_results` with each line's cursor, for a trainer that keeps its place
        across its own restarts: pass the last cursor it handled as ``after``."""
        path = f"/v1/batches/{_seg(batch_id)}/results"
        state = Resume(batch_id, after, resume_for)
        while True:
            try:
                with self._http.stream(
                    "GET",
                    path,
                    params=state.params(),
                    headers={"Accept": "application/x-ndjson"},
                    timeout=state.timeout(self.timeout),
                ) as response:
                    if response.is_error:
                        response.read()
                        raise _error_from_response(response)
                    state.opened = True
                    for line in response.iter_lines():
                        state.alive()
                        item = _result_line(line, response.status_code)
                        if item is not None:
                            state.take(item)
                            yield item
                    return
            except httpx.TransportError as exc:
                error = _transport_error(self.url, exc)
                error.__cause__ = exc
            except RolloutServiceError as exc:
                error = exc
            pause = state.retry_after(error.status_code)
            if pause is None:
                raise _stream_failure(state, error)
            time.sleep(pause)

    def cancel_batch(self, batch_id: str) -> BatchProgress:
        """``DELETE /v1/batches/{batch_id}``: cancel its unfinished jobs; returns the progress."""
        return _parse(BatchProgress, self._request("DELETE", f"/v1/batches/{_seg(batch_id)}"))

    def register_backend(
        self,
        url: str,
        model: str,
        kind: str = "vllm",
        id: str | None = None,
        policy_version: int | None = None,
        verify: bool = True,
        api: str | None = None,
        capacity: float | None = None,
        tokenizer: str | None = None,
        api_key: str | None = None,
    ) -> Backend:
        """``POST /v1/backends``: add (or update) an inference server.

        The gateway checks that the server answers and serves ``model`` unless ``verify`` is
        False (for a server that is still starting). ``api_key``: the bearer token the server
        asks for (its ``--api-key``), sent with every request to it and never shown back.
        """
        body = _backend_body(
            url, model, kind, id, policy_version, api, capacity, tokenizer, api_key
        )
        params = {} if verify else {"verify": "false"}
        return _parse(Backend, self._request("POST", "/v1/backends", json=body, params=params))

    def list_backends(self) -> list[Backend]:
        """``GET /v1/backends``, with each backend's in-flight count."""
        return _parse_backends(self._request("GET", "/v1/backends"))

    def remove_backend(self, backend_id: str) -> None:
        """``DELETE /v1/backends/{backend_id}``."""
        self._request("DELETE", f"/v1/backends/{_seg(backend_id)}")

    def drain_backend(
        self, backend_id: str | None = None, wait: float = 0.0
    ) -> Backend | list[Backend]:
        """``POST /v1/backends/{id}/drain`` (every backend when ``backend_id`` is None):
        nothing new is assigned, running requests finish. With ``wait``, answers once idle
        (``idle`` says whether it is)."""
        path = _drain_path(backend_id, "drain")
        response = self._request("POST", path, params={"wait": repr(float(wait))})
        return _backend_or_list(response)

    def resume_backend(
        self, backend_id: str | None = None, policy_version: int | None = None
    ) -> Backend | list[Backend]:
        """``POST /v1/backends/{id}/resume`` (every backend when ``backend_id`` is None),
        optionally announcing the policy version the weights now are."""
        path = _drain_path(backend_id, "resume")
        return _backend_or_list(self._request("POST", path, json=_resume_body(policy_version)))


class AsyncRolloutClient(AsyncSessions, AsyncWeightUpdates, _Base):
    """The same client for asyncio code: every method is a coroutine, and
    ``iter_batch_results`` an async iterator. Use ``async with``, or ``await aclose()``.
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60.0
    ) -> None:
        super().__init__(url, token, timeout)
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=self._headers, timeout=httpx.Timeout(timeout)
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc) from exc
        if response.is_error:
            raise _error_from_response(response)
        return response

    async def health(self) -> Health:
        """``GET /healthz``."""
        return _parse(Health, await self._request("GET", "/healthz"))

    async def stats(self) -> Stats:
        """``GET /v1/stats``."""
        return _parse(Stats, await self._request("GET", "/v1/stats"))

    async def submit_rollout(
        self,
        task: TaskLike,
        sampling: SamplingLike = None,
        agent: AgentLike = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> str | Trajectory:
        """As `RolloutClient.submit_rollout`."""
        response = await self._request(
            "POST",
            "/v1/rollouts",
            json=_rollout_body(task, sampling, agent),
            params=_wait_params(wait, timeout),
            timeout=self._wait_timeout(wait, timeout),
        )
        return _submitted(response)

    async def get_rollout(self, job_id: str) -> Trajectory:
        """``GET /v1/rollouts/{job_id}``."""
        return _parse(Trajectory, await self._request("GET", f"/v1/rollouts/{_seg(job_id)}"))

    async def cancel_rollout(self, job_id: str) -> Trajectory:
        """``DELETE /v1/rollouts/{job_id}``."""
        return _parse(Trajectory, await self._request("DELETE", f"/v1/rollouts/{_seg(job_id)}"))

    async def submit_batch(
        self,
        tasks: Sequence[TaskLike],
        group_size: int = 1,
        sampling: SamplingLike = None,
        agent: AgentLike = None,
        dynamic_sampling: DynamicLike = None,
    ) -> BatchAccepted:
        """``POST /v1/batches``."""
        body = _batch_body(tasks, group_size, sampling, agent, dynamic_sampling)
        response = await self._request("POST", "/v1/batches", json=body)
        return _parse(BatchAccepted, response)

    async def batch_progress(self, batch_id: str) -> BatchProgress:
        """``GET /v1/batches/{batch_id}``."""
        return _parse(BatchProgress, await self._request("GET", f"/v1/batches/{_seg(batch_id)}"))

    async def iter_batch_results(
        self, batch_id: str, after: str | None = None, resume_for: float = RESUME_SECONDS
    ) -> AsyncIterator[Trajectory]:
        """As `RolloutClient.iter_batch_results`, asynchronously (resuming the same way)."""
        async for item in self.iter_batch_lines(batch_id, after, resume_for):
            yield item.trajectory

    async def iter_batch_lines(
        self, batch_id: str, after: str | None = None, resume_for: float = RESUME_SECONDS
    ) -> AsyncIterator[ResultLine]:
        """As `RolloutClient.iter_batch_lines`, asynchronously."""
        path = f"/v1/batches/{_seg(batch_id)}/results"
        state = Resume(batch_id, after, resume_for)
        while True:
            try:
                async with self._http.stream(
                    "GET",
                    path,
                    params=state.params(),
                    headers={"Accept": "application/x-ndjson"},
                    timeout=state.timeout(self.timeout),
                ) as response:
                    if response.is_error:
                        await response.aread()
                        raise _error_from_response(response)
                    state.opened = True
                    async for line in response.aiter_lines():
                        state.alive()
                        item = _result_line(line, response.status_code)
                        if item is not None:
                            state.take(item)
                            yield item
                    return
            except httpx.TransportError as exc:
                error = _transport_error(self.url, exc)
                error.__cause__ = exc
            except RolloutServiceError as exc:
                error = exc
            pause = state.retry_after(error.status_code)
            if pause is None:
                raise _stream_failure(state, error)
            await asyncio.sleep(pause)

    async def cancel_batch(self, batch_id: str) -> BatchProgress:
        """``DELETE /v1/batches/{batch_id}``."""
        return _parse(BatchProgress, await self._request("DELETE", f"/v1/batches/{_seg(batch_id)}"))

    async def register_backend(
        self,
        url: str,
        model: str,
        kind: str = "vllm",
        id: str | None = None,
        policy_version: int | None = None,
        verify: bool = True,
        api: str | None = None,
        capacity: float | None = None,
        tokenizer: str | None = None,
        api_key: str | None = None,
    ) -> Backend:
        """``POST /v1/backends``; see `RolloutClient.register_backend`."""
        body = _backend_body(
            url, model, kind, id, policy_version, api, capacity, tokenizer, api_key
        )
        params = {} if verify else {"verify": "false"}
        response = await self._request("POST", "/v1/backends", json=body, params=params)
        return _parse(Backend, response)

    async def list_backends(self) -> list[Backend]:
        """``GET /v1/backends``."""
        return _parse_backends(await self._request("GET", "/v1/backends"))

    async def remove_backend(self, backend_id: str) -> None:
        """``DELETE /v1/backends/{backend_id}``."""
        await self._request("DELETE", f"/v1/backends/{_seg(backend_id)}")

    async def drain_backend(
        self, backend_id: str | None = None, wait: float = 0.0
    ) -> Backend | list[Backend]:
        """``POST /v1/backends/{id}/drain``; see `RolloutClient.drain_backend`."""
        path = _drain_path(backend_id, "drain")
        response = await self._request("POST", path, params={"wait": repr(float(wait))})
        return _backend_or_list(response)

    async def resume_backend(
        self, backend_id: str | None = None, policy_version: int | None = None
    ) -> Backend | list[Backend]:
        """``POST /v1/backends/{id}/resume``; see `RolloutClient.resume_backend`."""
        path = _drain_path(backend_id, "resume")
        response = await self._request("POST", path, json=_resume_body(policy_version))
        return _backend_or_list(response)
