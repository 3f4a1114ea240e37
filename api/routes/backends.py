"""`/v1/backends`: the inference servers jobs are assigned to."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Depends, HTTPException, Query, Response

from api.deps import services
from api.schemas import Backend, BackendSpec
from api.service import RequestError, Services

router = APIRouter(prefix="/v1/backends", tags=["backends"])


def check_reachable(spec: BackendSpec, timeout: float = 5.0) -> None:
    """Ask the server for its models; refuse a backend that does not answer or lacks the model."""
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


@router.post("", status_code=201, response_model=Backend)
def register(
    spec: BackendSpec,
    verify: bool = Query(True, description="check that the server answers and serves the model"),
    svc: Services = Depends(services),
) -> Backend:
    if spec.kind == "sglang":
        raise RequestError(
            422,
            "SGLang backends are not supported in this version; serve the model with vLLM",
            ["body", "kind"],
        )
    if verify:
        check_reachable(spec)
    return svc.pool.register(spec)


@router.get("", response_model=list[Backend])
def list_backends(svc: Services = Depends(services)) -> list[Backend]:
    return svc.pool.list()


@router.delete("/{backend_id}", status_code=204)
def remove(backend_id: str, svc: Services = Depends(services)) -> Response:
    if not svc.pool.remove(backend_id):
        raise HTTPException(status_code=404, detail=f"no backend with id {backend_id!r}")
    return Response(status_code=204)
