"""`/v1/sessions`: jobs driven by a harness outside the service.

`POST /v1/sessions` opens one (the tenant's bearer token, as every submission) and answers with
the session's base URL and key. Everything under `/v1/sessions/{job_id}/` (the model routes,
`tools/{name}`, `end`) is relayed to the RUN worker serving the session, which checks the
session's key: those requests carry the session key, not the gateway's token. While the session
is still starting (queued, its sandbox coming up) a request waits for it, up to
`ROLLSERVE_SESSION_WAIT` seconds.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from api import service
from api.deps import services, tenant
from api.errors import SUBMISSION
from api.ids import JobId
from api.service import Services
from broker.jobstore import JobNotFound
from core.schemas import JobStatus, SessionOpened, SessionRequest
from workers.harness.sessions import KEY_HASH

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
relay_router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

_FORWARDED = ("authorization", "x-api-key", "content-type", "accept", "anthropic-version")
_RETURNED = ("content-type", "x-should-retry", "retry-after", "cache-control")
POLL_SECONDS = 0.1


@router.post("", status_code=201, response_model=SessionOpened, responses=SUBMISSION)
def open_session(
    body: SessionRequest,
    request: Request,
    svc: Services = Depends(services),
    who: str = Depends(tenant),
) -> SessionOpened:
    """Open a session: its job starts (a sandbox when the task has one) and its harness sends
    model calls to `openai_base_url` / `anthropic_base_url` with `api_key`, runs the task's
    tools at `{base_url}/tools/{name}`, and ends it at `{base_url}/end`."""
    return service.open_session(svc, body, str(request.base_url), who)


def _error(request: Request, status: int, kind: str, message: str) -> JSONResponse:
    """A refusal in the shape of the relayed API (Anthropic's on its routes)."""
    headers = {"x-should-retry": "true" if status == 503 else "false"}
    if request.url.path.endswith("/v1/messages") or "anthropic-version" in request.headers:
        body: dict[str, object] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _address(svc: Services, job_id: str) -> tuple[JobStatus, str | None]:
    """Where the session is served, waiting while it starts."""
    deadline = time.monotonic() + svc.settings.session_wait
    while True:
        status, url = await asyncio.to_thread(svc.store.session_address, job_id, KEY_HASH)
        starting = status in (JobStatus.queued, JobStatus.init, JobStatus.run) and url is None
        if not starting or time.monotonic() >= deadline:
            return status, url
        await asyncio.sleep(POLL_SECONDS)


@relay_router.api_route("/{job_id}/{path:path}", methods=["GET", "POST"], include_in_schema=False)
async def relay(
    job_id: JobId, path: str, request: Request, svc: Services = Depends(services)
) -> Response:
    """The session's own routes, answered by the RUN worker that serves it."""
    try:
        status, url = await _address(svc, job_id)
    except JobNotFound:
        return _error(request, 404, "not_found_error", f"no session {job_id}")
    if url is None:
        if status.terminal or status is JobStatus.eval:
            return _error(request, 404, "not_found_error", f"session {job_id} has ended")
        return _error(request, 503, "overloaded_error", f"session {job_id} is still starting")
    client = session_client(request.app)
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
    outgoing = client.build_request(
        request.method,
        f"{url}/{path}",
        headers=headers,
        content=await request.body(),
        params=request.query_params,
    )
    try:
        answer = await client.send(outgoing, stream=True)
    except httpx.HTTPError:
        return _error(request, 502, "api_error", f"session {job_id} did not answer (it ended?)")
    returned = {k: v for k, v in answer.headers.items() if k.lower() in _RETURNED}
    return StreamingResponse(
        answer.aiter_raw(),
        status_code=answer.status_code,
        headers=returned,
        background=BackgroundTask(answer.aclose),
    )


def session_client(app: FastAPI) -> httpx.AsyncClient:
    """The gateway's client of the workers serving sessions, made on first use (no timeout
    on a model call: the session's own budgets bound it); `close_session_client` closes it."""
    client: httpx.AsyncClient | None = getattr(app.state, "session_client", None)
    if client is None:
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        app.state.session_client = client
    return client


async def close_session_client(app: FastAPI) -> None:
    client: httpx.AsyncClient | None = getattr(app.state, "session_client", None)
    if client is not None:
        app.state.session_client = None
        await client.aclose()
