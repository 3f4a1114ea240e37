"""The FastAPI gateway: app factory, auth, body-size limit, error shapes."""

from __future__ import annotations

import secrets
from typing import Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.routes import backends, batches, rollouts, system
from api.service import RequestError, Services
from broker.celery_app import create_celery
from broker.jobstore import JobNotFound, JobStore
from broker.settings import Settings, get_settings
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


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


_bearer = HTTPBearer(auto_error=False)


def require_token(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    """With ROLLSERVE_API_TOKEN set, every /v1 call must carry it as a bearer token."""
    expected = request.app.state.services.settings.api_token
    if not expected:
        return
    if credentials is None or not secrets.compare_digest(credentials.credentials, expected):
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
    client = redis.Redis.from_url(settings.redis_url)
    return Services(
        settings=settings,
        store=JobStore(client, settings.key_prefix, settings.job_ttl),
        pool=BackendPool(client, settings.key_prefix),
        celery=create_celery(settings, settings.redis_url),
    )


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    """The gateway app; `services` may be injected (tests), otherwise built from `settings`."""
    settings = settings or get_settings()
    app = FastAPI(
        title="rollserve",
        version="0.1.0",
        description="Rollout-as-a-service for RL of multi-turn LLM agents.",
    )
    app.state.services = services or build_services(settings)
    auth = [Depends(require_token)]
    app.include_router(rollouts.router, dependencies=auth)
    app.include_router(batches.router, dependencies=auth)
    app.include_router(backends.router, dependencies=auth)
    app.include_router(system.v1_router, dependencies=auth)
    app.include_router(system.open_router)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
        detail: Any = exc.message
        if exc.loc:
            detail = [{"loc": exc.loc, "msg": exc.message, "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=exc.status_code)

    @app.exception_handler(JobNotFound)
    async def _not_found(_request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": f"no job or batch with id {exc.args[0]!r}"}, status_code=404)

    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    return app
