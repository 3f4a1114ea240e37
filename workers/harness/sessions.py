"""RUN for a session: a job driven by a harness outside the service, over HTTP.

The gateway opened the session (`POST /v1/sessions`) and gave the caller a key; the job record
holds only the key's SHA-256. RUN serves the job's endpoint on TCP (`ROLLSERVE_SESSION_HOST`,
a free port), records its address in the job (`session_url`), and the gateway relays the
caller's requests there. Besides the model routes, the session serves the box's tools
(`POST /tools/{name}` with the tool's arguments as JSON, when the task has a sandbox) and its
end (`POST /end` with `{"reward": x}` or `{"grade": true}`). RUN ends with the session: at its
end, when it has been idle for `idle_seconds`, when its time budget runs out, or when the job
is cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from core.schemas import HarnessRun, SessionEnd
from sandbox.toolclient import AsyncToolClient
from workers.agent import Limits
from workers.harness.run import HarnessEpisode, wait_watched
from workers.harness.server import endpoint_of, json_body, make_app, serve_tcp, stop_server
from workers.harness.session import HarnessSession, RoutedModel
from workers.harness.toolparsers import get_parser
from workers.harness.wire import ApiError, ChatRequest, ChatResult
from workers.toolcalls import bounded_arguments, format_result
from workers.trajectory import TrajectoryBuilder

KEY_HASH = "session_key_sha256"
"""The job's `agent` field holding its session key's SHA-256 (hex)."""
IDLE = "session_idle"
"""The job's `agent` field holding its idle timeout in seconds."""


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class SessionJob:
    job_id: str
    key_sha256: str
    idle_seconds: float
    model: str
    parser: str
    tools: list[dict[str, Any]] | None
    socket_path: str | None
    """The box's tool server, when the task has a sandbox."""
    tool_timeout: float


class OutsideSession:
    """The session's endpoint: the job's model calls, its box's tools and its end."""

    def __init__(self, session: HarnessSession, job: SessionJob) -> None:
        self.session = session
        self.job = job
        self.ended = asyncio.Event()
        self.ending: SessionEnd | None = None
        self.last_seen = time.monotonic()
        self.declared = {(t.get("function") or t).get("name") for t in job.tools or []}
        self.tools = (
            AsyncToolClient(job.socket_path, timeout=job.tool_timeout + 30)
            if job.socket_path
            else None
        )

    @property
    def model(self) -> str:
        return self.session.model

    async def generate(self, request: ChatRequest) -> ChatResult:
        self.last_seen = time.monotonic()
        try:
            return await self.session.generate(request)
        finally:
            self.last_seen = time.monotonic()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.last_seen = time.monotonic()
        if self.tools is None or name not in self.declared or name == "finish":
            known = ", ".join(sorted(n for n in self.declared if n and n != "finish"))
            raise ApiError("not_found", f"the session has no tool {name!r}; its tools: {known}")
        bounded = bounded_arguments(name, arguments, self.job.tool_timeout)
        try:
            result = await self.tools.call(name, **bounded)
        except Exception as exc:  # the caller's arguments, or the tool's own failure
            why = getattr(exc, "message", None) or exc
            raise ApiError("invalid_request", f"{name}: {why}") from None
        finally:
            self.last_seen = time.monotonic()
        return {"result": result, "text": format_result(name, result)}

    async def close(self) -> None:
        if self.tools is not None:
            await self.tools.close()


def session_app(outside: OutsideSession) -> web.Application:
    """The endpoint's app with the session's `/tools/{name}` and `/end` routes."""

    async def find(given: str) -> OutsideSession | None:
        good = hmac.compare_digest(key_hash(given), outside.job.key_sha256)
        return outside if good and not outside.ended.is_set() else None

    async def tools(request: web.Request) -> web.Response:
        await endpoint_of(request)
        arguments = await _json_object(request)
        answer = await outside.call_tool(request.match_info["name"], arguments)
        return web.json_response(answer)

    async def end(request: web.Request) -> web.Response:
        await endpoint_of(request)
        try:
            outside.ending = SessionEnd.model_validate(await _json_object(request))
        except ValidationError as exc:
            why = exc.errors()[0]["msg"]
            raise ApiError("invalid_request", f"the end of a session: {why}") from None
        outside.ended.set()
        return web.json_response({"job_id": outside.job.job_id, "ended": True})

    app = make_app(find)
    app.router.add_post("/tools/{name}", tools)
    app.router.add_post("/end", end)
    return app


async def _json_object(request: web.Request) -> dict[str, Any]:
    body = await json_body(request) if await request.read() else {}
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the body must be a JSON object")
    return body


async def run_session_episode(
    job: SessionJob,
    policy: RoutedModel,
    limits: Limits,
    *,
    host: str,
    publish: Callable[[str | None], Awaitable[None]],
    is_live: Callable[[], bool] = lambda: True,
    on_turn: Callable[[TrajectoryBuilder], Awaitable[object] | None] = lambda _b: None,
    time_limit: float | None = None,
) -> HarnessEpisode:
    """Serve the session until it ends; `publish` records its address (None: gone). Raises
    what ended the job from inside a call (`JobCancelled`, `StalePolicy`)."""
    session = HarnessSession(
        job.job_id, policy, limits, get_parser(job.parser), model=job.model, on_turn=on_turn
    )
    outside = OutsideSession(session, job)
    runner = await serve_tcp(session_app(outside), host, 0)
    port = runner.addresses[0][1]
    reason = "session_end"
    try:
        await publish(f"http://{_url_host(host)}:{port}")
        reason = await _until_ended(outside, limits, is_live, time_limit)
    finally:
        await stop_server(runner)
        await outside.close()
        await session.flush()
        await publish(None)
    if session.failure is not None:
        raise session.failure
    builder = session.builder or TrajectoryBuilder([])
    record = HarnessRun(command=None, calls=session.calls, refused_calls=session.refused)
    ending = outside.ending
    reward = ending.reward if ending is not None else None
    if session.stop_reason is not None and reason == "session_end":
        reason = session.stop_reason
    truncated = reason not in ("session_end",)
    return HarnessEpisode(builder, reason, truncated, harness=record, reward=reward)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _until_ended(
    outside: OutsideSession, limits: Limits, is_live: Callable[[], bool], time_limit: float | None
) -> str:
    """Why the session ended: `session_end`, `session_idle` or `time_budget`."""
    started = time.monotonic()
    ended: asyncio.Future[Any] = asyncio.ensure_future(outside.ended.wait())
    try:
        while True:
            idle_left = outside.job.idle_seconds - (time.monotonic() - outside.last_seen)
            bounds = [idle_left]
            if limits.time_left() is not None:
                bounds.append(limits.time_left() or 0.0)
            if time_limit is not None:
                bounds.append(time_limit - (time.monotonic() - started))
            if await wait_watched(ended, outside.session, is_live, timeout=max(0.0, min(bounds))):
                return "session_end"
            if limits.time_left() == 0 or (
                time_limit is not None and time.monotonic() - started >= time_limit
            ):
                return "time_budget"
            if time.monotonic() - outside.last_seen >= outside.job.idle_seconds:
                return "session_idle"
    finally:
        ended.cancel()
