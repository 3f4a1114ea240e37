"""Health, readiness, Prometheus metrics and fleet statistics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from api.deps import services
from api.metrics import collect_stats, registry_for
from api.readiness import ReadinessProbe
from api.service import Services
from core.schemas import Health, Readiness, Stats

open_router = APIRouter(tags=["system"])
metrics_router = APIRouter(tags=["system"])
"""`/metrics`: behind the bearer token like /v1 when tokens are configured."""
v1_router = APIRouter(prefix="/v1", tags=["system"])


@open_router.get("/healthz", response_model=Health)
def healthz(response: Response, svc: Services = Depends(services)) -> Health:
    try:
        svc.store.r.ping()
        backends = svc.pool.count()
    except RedisError:
        response.status_code = 503
        return Health(status="degraded", redis=False, backends=0)
    return Health(status="ok", redis=True, backends=backends)


@open_router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready: `missing` names what."}},
)
def readyz(request: Request, response: Response, svc: Services = Depends(services)) -> Readiness:
    """200 once every queue (init, run, eval) has a live worker and a healthy backend is
    registered; otherwise 503 naming what is missing."""
    probe = getattr(request.app.state, "readiness", None)
    if probe is None:
        probe = request.app.state.readiness = ReadinessProbe()
    missing = probe.missing(svc)
    if missing:
        response.status_code = 503
    return Readiness(ready=not missing, missing=missing)


@metrics_router.get("/metrics", response_class=Response)
def metrics(request: Request, svc: Services = Depends(services)) -> Response:
    registry = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        registry = request.app.state.metrics_registry = registry_for(svc)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@v1_router.get("/stats", response_model=Stats)
def stats(svc: Services = Depends(services)) -> Stats:
    return collect_stats(svc)
