"""`/v1/backends`: the inference servers jobs are assigned to, and their drain/resume for weight
updates."""

from __future__ import annotations

import time

import httpx
from fastapi import APIRouter, Depends, HTTPException, Query, Response

from api.deps import services
from api.schemas import Backend, BackendSpec, ResumeRequest
from api.service import RequestError, Services
from routing.pool import BackendPool

router = APIRouter(prefix="/v1/backends", tags=["backends"])

MAX_DRAIN_WAIT = 3600.0


def check_reachable(spec: BackendSpec, timeout: float = 5.0) -> None:
    """Ask the server for its models; refuse a backend that does not answer or lacks the model.

    vLLM and SGLang both serve the OpenAI-compatible `GET /v1/models`.
    """
    url = spec.url.rstrip("/") + "/v1/models"
    try:
        answer = httpx.get(url, timeout=timeout)
        answer.raise_for_status()
        served = [m.get("id") for m in answer.json().get("data", [])]
    except (httpx.HTTPError, ValueError) as exc:
        raise RequestError(
            422, f"backend {spec.url} did not answer GET /v1/models: {exc}", ["body", "url"]
        ) from None
    if served and spec.model not in served:
        raise RequestError(
            422, f"backend {spec.url} serves {served}, not {spec.model!r}", ["body", "model"]
        )


def wait_until_idle(pool: BackendPool, ids: list[str], wait: float) -> list[Backend]:
    """The backends once none of them is held by a job, or as they are after `wait` seconds."""
    deadline = time.monotonic() + min(wait, MAX_DRAIN_WAIT)
    while True:
        backends = [b for b in (pool.get(i) for i in ids) if b is not None]
        if all(b.idle for b in backends) or time.monotonic() >= deadline:
            return backends
        time.sleep(0.05)


def _known(pool: BackendPool, backend_id: str) -> Backend:
    backend = pool.get(backend_id)
    if backend is None:
        raise HTTPException(status_code=404, detail=f"no backend with id {backend_id!r}")
    return backend


WAIT = Query(
    0.0,
    ge=0.0,
    le=MAX_DRAIN_WAIT,
    description="seconds to wait until the drained backends are idle (no job holds them)",
)


@router.post("", status_code=201, response_model=Backend)
def register(
    spec: BackendSpec,
    verify: bool = Query(True, description="check that the server answers and serves the model"),
    svc: Services = Depends(services),
) -> Backend:
    if spec.kind == "sglang" and spec.api != "completions":
        raise RequestError(
            422, "`api` applies to vLLM only; SGLang is spoken through /generate", ["body", "api"]
        )
    if spec.kind != "sglang" and spec.tokenizer is not None:
        raise RequestError(
            422,
            "`tokenizer` applies to SGLang only; vLLM renders chat templates through /tokenize",
            ["body", "tokenizer"],
        )
    if verify:
        check_reachable(spec)
    return svc.pool.register(spec)


@router.get("", response_model=list[Backend])
def list_backends(svc: Services = Depends(services)) -> list[Backend]:
    return svc.pool.list()


@router.post("/drain", response_model=list[Backend])
def drain_all(wait: float = WAIT, svc: Services = Depends(services)) -> list[Backend]:
    """Assign nothing new to any backend; running requests finish and their jobs wait between
    turns until a backend is resumed. With `wait`, answers once every backend is idle."""
    ids = svc.pool.ids()
    for backend_id in ids:
        svc.pool.drain(backend_id)
    return wait_until_idle(svc.pool, ids, wait)


@router.post("/resume", response_model=list[Backend])
def resume_all(
    body: ResumeRequest | None = None, svc: Services = Depends(services)
) -> list[Backend]:
    """Every backend takes work again, optionally announcing the policy version it now holds."""
    version = body.policy_version if body else None
    for backend_id in svc.pool.ids():
        svc.pool.resume(backend_id, version)
    return svc.pool.list()


@router.get("/{backend_id}", response_model=Backend)
def get_backend(backend_id: str, svc: Services = Depends(services)) -> Backend:
    return _known(svc.pool, backend_id)


@router.post("/{backend_id}/drain", response_model=Backend)
def drain(backend_id: str, wait: float = WAIT, svc: Services = Depends(services)) -> Backend:
    """Assign nothing new to this backend; its jobs move to others after their running request.
    `idle` in the answer says when its weights can be swapped (with `wait`, once it is)."""
    if not svc.pool.drain(backend_id):
        _known(svc.pool, backend_id)
    backends = wait_until_idle(svc.pool, [backend_id], wait)
    return backends[0] if backends else _known(svc.pool, backend_id)


@router.post("/{backend_id}/resume", response_model=Backend)
def resume(
    backend_id: str, body: ResumeRequest | None = None, svc: Services = Depends(services)
) -> Backend:
    """The backend takes work again, optionally announcing the policy version it now holds."""
    if not svc.pool.resume(backend_id, body.policy_version if body else None):
        _known(svc.pool, backend_id)
    return _known(svc.pool, backend_id)


@router.delete("/{backend_id}", status_code=204)
def remove(backend_id: str, svc: Services = Depends(services)) -> Response:
    if not svc.pool.remove(backend_id):
        raise HTTPException(status_code=404, detail=f"no backend with id {backend_id!r}")
    return Response(status_code=204)
