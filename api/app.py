"""The FastAPI gateway: app factory, auth, body-size limit, error shapes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kombu.exceptions import KombuError
from kombu.exceptions import OperationalError as BrokerUnreachable
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import tenant_of
from api.errors import error_responses, http_error, json_safe, validation_error
from api.routes import backends, batches, rollouts, sessions, system
from api.service import RequestError, Services
from api.ui.routes import install as install_console
from api.waits import close_async_redis
from broker.celery_app import create_celery
from broker.connections import redis_client
from broker.jobstore import JobNotFound, JobStore
from core.settings import Settings, get_settings
from routing.pool import BackendPool


class BodySizeLimit:
    """Answers 413 to a request whose body exceeds `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        # Read the whole body first (it is bounded), so an oversized one never reaches a route.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse(
            {"detail": f"request body is larger than the {self.limit}-byte limit"}, status_code=413
        )
        await response({"type": "http"}, _no_receive, send)


class NoFraming:
    """Every answer forbids being shown in a frame of another page (`X-Frame-Options: DENY`,
    `Content-Security-Policy: frame-ancestors 'none'`), so no site can overlay the console's
    buttons on its own (clickjacking)."""

    HEADERS = [
        (b"x-frame-options", b"DENY"),
        (b"content-security-policy", b"frame-ancestors 'none'"),
    ]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.HEADERS if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_guarded)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


STORE_FULL = (
    "the job store is full: Redis has reached its memory cap (maxmemory) and refuses writes. "
    "Retry later: finished jobs free their memory after ROLLSERVE_JOB_TTL; or raise the cap "
    "(ROLLSERVE_REDIS_MAXMEMORY for the embedded Redis)"
)
REDIS_UNREACHABLE = "Redis (the job store and broker) is unreachable; retry later"
GATEWAY_REDIS_RETRY_SECONDS = 2.0
"""Longest a gateway request retries a lost Redis before it answers 503."""


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it was raised from, is Redis refusing a write for memory."""
    seen = 0
    while exc is not None and seen < 8:
        # Redis: "OOM command not allowed when used memory > 'maxmemory'" (redis-py drops the
        # "OOM" code when it maps the reply to its OutOfMemoryError).
        if "used memory > 'maxmemory'" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


async def _redis_error(_request: Request, exc: Exception) -> JSONResponse:
    """Redis full or unreachable is a 503 naming it; any other Redis error stays a 500."""
    if _out_of_memory(exc):
        return JSONResponse({"detail": STORE_FULL}, status_code=503)
    if isinstance(
        exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | BrokerUnreachable
    ):
        return JSONResponse({"detail": REDIS_UNREACHABLE}, status_code=503)
    raise exc


_bearer = HTTPBearer(auto_error=False)


def require_token(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    """With ROLLSERVE_API_TOKEN (or ROLLSERVE_TENANT_TOKENS) set, every /v1 call must carry one
    of the tokens as a bearer token."""
    if tenant_of(request.app.state.services.settings, credentials) is None:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token (Authorization: Bearer <ROLLSERVE_API_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


def build_services(settings: Settings) -> Services:
    if not settings.redis_url:
        raise RuntimeError(
            "the gateway needs ROLLSERVE_REDIS_URL (or start it with `rollserve up`)"
        )
    # A request waits briefly for a Redis that is restarting, then gets its 503.
    client = redis_client(
        settings.redis_url, min(settings.redis_retry_seconds, GATEWAY_REDIS_RETRY_SECONDS)
    )
    return Services(
        settings=settings,
        store=JobStore.for_settings(client, settings),
        pool=BackendPool(client, settings.key_prefix),
        celery=create_celery(settings, settings.redis_url),
    )


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await sessions.close_session_client(app)
    await close_async_redis(app)


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    """The gateway app; `services` may be injected (tests), otherwise built from `settings`."""
    settings = settings or get_settings()
    app = FastAPI(
        lifespan=_lifespan,
        title="rollserve",
        version="0.1.0",
        description="Rollout-as-a-service for RL of multi-turn LLM agents.",
    )
    app.state.services = services or build_services(settings)
    # The bearer scheme (and its 401) is in the OpenAPI only when a token is configured.
    token = bool(app.state.services.settings.tokens())
    auth = [Depends(require_token)] if token else []
    v1 = error_responses(*((401, 503) if token else (503,)))
    app.include_router(rollouts.router, dependencies=auth, responses=v1)
    app.include_router(sessions.router, dependencies=auth, responses=v1)
    # A session's own routes carry its key, checked by the worker serving it.
    app.include_router(sessions.relay_router)
    app.include_router(batches.router, dependencies=auth, responses=v1)
    app.include_router(backends.router, dependencies=auth, responses=v1)
    app.include_router(system.v1_router, dependencies=auth, responses=v1)
    app.include_router(system.open_router)
    app.include_router(system.metrics_router, dependencies=auth, responses=v1)
    install_console(app)
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
        detail: Any = exc.message
        if exc.loc:
            detail = [{"loc": exc.loc, "msg": exc.message, "type": "value_error"}]
        return JSONResponse({"detail": json_safe(detail)}, status_code=exc.status_code)

    @app.exception_handler(JobNotFound)
    async def _not_found(_request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": f"no job or batch with id {exc.args[0]!r}"}, status_code=404)

    app.add_exception_handler(redis.exceptions.RedisError, _redis_error)
    app.add_exception_handler(KombuError, _redis_error)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(NoFraming)
    return app
