"""The console's routes under `/ui`: thin adapters over `api.ui.views` and `api.service`.

Route functions are synchronous, so FastAPI runs them in its thread pool and a slow page never
holds the gateway's other requests. A tenant's console lists and opens only its own batches
and rollouts (another tenant's answer as unknown ones do); the fleet and backend pages are the
admin's."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path
from threading import Lock
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from api import owners, service
from api.deps import Caller, caller_of, services
from api.ids import BATCH_ID, JOB_ID
from api.service import Services
from api.ui import views
from api.ui.auth import (
    COOKIE_PATH,
    TOKEN_COOKIE,
    AdminRequired,
    SignInRequired,
    check_post,
    console_admin,
    console_user,
    credentials_of,
    csrf_token,
    is_https,
    same_origin,
    set_csrf_cookie,
)
from api.ui.engines import EngineMetrics
from api.ui.tokens import (
    decode,
    load_tokenizer,
    segment_views,
    shade,
    token_slice,
    tokenizer_source,
)
from broker.jobstore import JobNotFound
from core.schemas import STAGES, JobStatus, ModelTurn, Trajectory
from routing.sglang import tokenizer_roots

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["shade"] = shade
templates.env.filters["utc"] = lambda ts: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
templates.env.filters["pretty"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False)

BATCHES_PER_PAGE = 25
JOBS_PER_PAGE = 50
TOKENS_PER_CHUNK = 1000
TURNS_PER_CHUNK = 20
STATUS_FILTERS = [s.value for s in JobStatus] + ["expired"]

router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(console_user)])
open_router = APIRouter(prefix="/ui", include_in_schema=False)
ADMIN_PAGE = [Depends(console_admin)]
engines = EngineMetrics()


async def form_fields(request: Request) -> dict[str, str]:
    """The fields of an urlencoded form body (the console's forms are small)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return dict(parse_qsl(body, keep_blank_values=True))


def render(
    request: Request, name: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    who = caller_of(services(request).settings, credentials_of(request))
    context = {
        "csrf": csrf_token(request),
        "signed_in": _has_tokens(request),
        "admin": who is not None and who.admin,
        **context,
    }
    response = templates.TemplateResponse(request, name, context, status_code=status_code)
    set_csrf_cookie(request, response)
    return response


def _has_tokens(request: Request) -> bool:
    return bool(services(request).settings.tokens())


def not_found(request: Request, what: str) -> HTMLResponse:
    return render(request, "not_found.html", {"what": what}, status_code=404)


def _batch_id(svc: Services, me: Caller, batch_id: str) -> str:
    """The id of a batch the caller may see; JobNotFound otherwise."""
    if not BATCH_ID.fullmatch(batch_id):
        raise JobNotFound(batch_id)
    owners.check_batch(svc.store, me.tenant, me.admin, batch_id)
    return batch_id


def _job_id(svc: Services, me: Caller, job_id: str) -> str:
    """The id of a job the caller may see; JobNotFound otherwise."""
    if not JOB_ID.fullmatch(job_id):
        raise JobNotFound(job_id)
    owners.check_job(svc.store, me.tenant, me.admin, job_id)
    return job_id


# ---------------------------------------------------------------------- sign-in
@open_router.get("/signin", response_class=HTMLResponse)
def signin_form(request: Request) -> HTMLResponse:
    return render(request, "signin.html", {"error": None})


@open_router.post("/signin", response_model=None)
def signin(request: Request, fields: dict[str, str] = Depends(form_fields)) -> Response:
    if not same_origin(request):
        raise HTTPException(403, "cross-site request refused: its Origin is not this console")
    token = fields.get("token", "").strip()
    given = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) if token else None
    if caller_of(services(request).settings, given) is None:
        return render(request, "signin.html", {"error": "wrong token"}, status_code=401)
    response = RedirectResponse("/ui/batches", status_code=303)
    response.set_cookie(
        TOKEN_COOKIE,
        token,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=is_https(request),
    )
    return response


@open_router.post("/signout", response_model=None)
def signout(request: Request, fields: dict[str, str] = Depends(form_fields)) -> Response:
    check_post(request, fields)
    response = RedirectResponse("/ui/signin", status_code=303)
    response.delete_cookie(TOKEN_COOKIE, path=COOKIE_PATH)
    return response


# ---------------------------------------------------------------------- batches
@router.get("", response_model=None)
def home() -> Response:
    return RedirectResponse("/ui/batches", status_code=303)


@router.get("/batches", response_class=HTMLResponse)
def batches_page(
    request: Request,
    page: int = Query(1, ge=1, le=1_000_000),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    offset = (page - 1) * BATCHES_PER_PAGE
    rows, total = views.batch_rows(svc, offset, BATCHES_PER_PAGE, None if me.admin else me.tenant)
    return render(
        request,
        "batches.html",
        {
            "rows": rows,
            "page": page,
            "pages": max(1, -(-total // BATCHES_PER_PAGE)),
            "total": total,
        },
    )


def _batch_context(svc: Services, batch_id: str) -> dict[str, Any]:
    progress = service.batch_progress(svc, batch_id)
    rewards = views.batch_rewards(svc, batch_id)
    return {
        "progress": progress,
        "bins": views.histogram(views.reward_values(rewards)),
        "groups": views.group_summary(rewards, progress.group_size),
        "sampled": len(rewards),
        "sample_limit": views.HISTOGRAM_JOBS,
    }


def _jobs_context(svc: Services, batch_id: str, page: int, status: str | None) -> dict[str, Any]:
    if status is not None and status not in STATUS_FILTERS:
        raise HTTPException(
            422, f"status must be one of {', '.join(STATUS_FILTERS)} (got {status!r})"
        )
    jobs = svc.store.batch_jobs_page(batch_id, (page - 1) * JOBS_PER_PAGE, JOBS_PER_PAGE, status)
    return {"jobs": jobs, "status": status, "page": page, "statuses": STATUS_FILTERS}


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
def batch_page(
    request: Request,
    batch_id: str,
    page: int = Query(1, ge=1, le=1_000_000),
    status: str | None = Query(None, max_length=20),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        context = _batch_context(svc, _batch_id(svc, me, batch_id))
    except JobNotFound:
        return not_found(request, f"batch {batch_id}")
    context.update(_jobs_context(svc, batch_id, page, status or None))
    return render(request, "batch.html", {"batch_id": batch_id, **context})


@router.get("/batches/{batch_id}/progress", response_class=HTMLResponse)
def batch_progress_fragment(
    request: Request,
    batch_id: str,
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        context = _batch_context(svc, _batch_id(svc, me, batch_id))
    except JobNotFound:
        return not_found(request, f"batch {batch_id}")
    return render(request, "batch_progress.html", {"batch_id": batch_id, **context})


@router.get("/batches/{batch_id}/jobs", response_class=HTMLResponse)
def batch_jobs_fragment(
    request: Request,
    batch_id: str,
    page: int = Query(1, ge=1, le=1_000_000),
    status: str | None = Query(None, max_length=20),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        svc.store.batch_progress(_batch_id(svc, me, batch_id))
    except JobNotFound:
        return not_found(request, f"batch {batch_id}")
    context = _jobs_context(svc, batch_id, page, status or None)
    return render(request, "batch_jobs.html", {"batch_id": batch_id, **context})


@router.post("/batches/{batch_id}/cancel", response_model=None)
def cancel_batch(
    request: Request,
    batch_id: str,
    fields: dict[str, str] = Depends(form_fields),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> Response:
    check_post(request, fields)
    try:
        service.cancel_batch(svc, _batch_id(svc, me, batch_id), wait=0.0)
    except JobNotFound:
        return not_found(request, f"batch {batch_id}")
    return RedirectResponse(f"/ui/batches/{batch_id}", status_code=303)


# ---------------------------------------------------------------------- fleet and backends
@router.get("/fleet", response_class=HTMLResponse, dependencies=ADMIN_PAGE)
def fleet_page(request: Request, svc: Services = Depends(services)) -> HTMLResponse:
    return render(request, "fleet.html", {"fleet": views.fleet(svc), "fragment": False})


@router.get("/fleet/stats", response_class=HTMLResponse, dependencies=ADMIN_PAGE)
def fleet_fragment(request: Request, svc: Services = Depends(services)) -> HTMLResponse:
    return render(request, "fleet_stats.html", {"fleet": views.fleet(svc)})


@router.get("/backends", response_class=HTMLResponse, dependencies=ADMIN_PAGE)
def backends_page(request: Request, svc: Services = Depends(services)) -> HTMLResponse:
    return render(request, "backends.html", {"backends": svc.pool.list()})


@router.get("/backends/{backend_id}/engine", response_class=HTMLResponse, dependencies=ADMIN_PAGE)
def engine_fragment(
    request: Request, backend_id: str, svc: Services = Depends(services)
) -> HTMLResponse:
    backend = svc.pool.get(backend_id)
    if backend is None:
        return not_found(request, f"backend {backend_id}")
    return render(request, "engine.html", {"reading": engines.reading(backend)})


@router.post("/backends/{backend_id}/{action}", response_model=None, dependencies=ADMIN_PAGE)
def backend_action(
    request: Request,
    backend_id: str,
    action: str,
    fields: dict[str, str] = Depends(form_fields),
    svc: Services = Depends(services),
) -> Response:
    check_post(request, fields)
    if action not in ("drain", "resume"):
        return not_found(request, f"action {action}")
    if svc.pool.get(backend_id) is None:
        return not_found(request, f"backend {backend_id}")
    if action == "drain":
        svc.pool.drain(backend_id)
    else:
        svc.pool.resume(backend_id)
    return RedirectResponse("/ui/backends", status_code=303)


# ---------------------------------------------------------------------- trajectory viewer
class TrajectoryCache:
    """Finished trajectories recently shown, so the viewer's chunks do not each re-read a
    long record; unfinished ones are read afresh."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._items: OrderedDict[str, Trajectory] = OrderedDict()
        self._lock = Lock()

    def get(self, svc: Services, job_id: str) -> Trajectory:
        with self._lock:
            if job_id in self._items:
                self._items.move_to_end(job_id)
                return self._items[job_id]
        trajectory = svc.store.trajectory(job_id)
        if trajectory.status.terminal:
            with self._lock:
                self._items[job_id] = trajectory
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        return trajectory


trajectories = TrajectoryCache()


def _tokenizer(svc: Services, trajectory: Trajectory) -> Any:
    known = [svc.settings.tiny_model_dir.resolve()]
    roots = tokenizer_roots(svc.settings)
    source = tokenizer_source(svc.pool.get(trajectory.backend_id or ""), known, roots)
    return load_tokenizer(source) if source else None


def _waterfall(trajectory: Trajectory) -> list[tuple[str, float, float]]:
    """(stage, start, seconds) of queue, init, run and eval, one after the other."""
    bars = []
    start = 0.0
    for stage in ("queue", *STAGES):
        seconds = getattr(trajectory.timing, stage) or 0.0
        bars.append((stage, start, seconds))
        start += seconds
    return bars


@router.get("/rollouts/{job_id}", response_class=HTMLResponse)
def rollout_page(
    request: Request,
    job_id: str,
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        trajectory = trajectories.get(svc, _job_id(svc, me, job_id))
    except JobNotFound:
        return not_found(request, f"job {job_id}")
    bars = _waterfall(trajectory)
    segments = segment_views(trajectory)
    return render(
        request,
        "rollout.html",
        {
            "t": trajectory,
            "bars": bars,
            "wall": max(1e-9, sum(b[2] for b in bars)),
            "segments": segments,
            "tokens_total": sum(s.total for s in segments),
            "generated": sum(s.generated for s in segments),
            "decoded": _tokenizer(svc, trajectory) is not None,
            "blocks": views.json_blocks(trajectory.eval),
            "outcome": views.json_blocks(trajectory.outcome),
            "turn_chunk": TURNS_PER_CHUNK,
            "versions": sorted(
                {t.policy_version for t in trajectory.turns if isinstance(t, ModelTurn)},
                key=lambda v: -1 if v is None else v,
            ),
        },
    )


def version_changes(trajectory: Trajectory) -> set[int]:
    """Indexes of the model turns whose policy version differs from the previous model turn's."""
    changes: set[int] = set()
    previous: ModelTurn | None = None
    for index, turn in enumerate(trajectory.turns):
        if isinstance(turn, ModelTurn):
            if previous is not None and previous.policy_version != turn.policy_version:
                changes.add(index)
            previous = turn
    return changes


@router.get("/rollouts/{job_id}/turns", response_class=HTMLResponse)
def turns_fragment(
    request: Request,
    job_id: str,
    start: int = Query(0, ge=0, le=10_000_000),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        trajectory = trajectories.get(svc, _job_id(svc, me, job_id))
    except JobNotFound:
        return not_found(request, f"job {job_id}")
    turns = list(enumerate(trajectory.turns))[start : start + TURNS_PER_CHUNK]
    segments = segment_views(trajectory)
    return render(
        request,
        "turns.html",
        {
            "t": trajectory,
            "turns": turns,
            "changes": version_changes(trajectory),
            # Where each segment begins, marked when there is more than one.
            "starts": {s.first_turn: s for s in segments} if len(segments) > 1 else {},
            "next": start + TURNS_PER_CHUNK
            if start + TURNS_PER_CHUNK < len(trajectory.turns)
            else None,
        },
    )


@router.get("/rollouts/{job_id}/tokens", response_class=HTMLResponse)
def tokens_fragment(
    request: Request,
    job_id: str,
    start: int = Query(0, ge=0, le=100_000_000),
    segment: int = Query(1, ge=1, le=1_000_000),
    svc: Services = Depends(services),
    me: Caller = Depends(console_user),
) -> HTMLResponse:
    try:
        trajectory = trajectories.get(svc, _job_id(svc, me, job_id))
    except JobNotFound:
        return not_found(request, f"job {job_id}")
    segments = segment_views(trajectory)
    if segment > len(segments):
        return not_found(request, f"segment {segment} of job {job_id}")
    tokens = token_slice(trajectory, start, TOKENS_PER_CHUNK, segment)
    tokenizer = _tokenizer(svc, trajectory)
    if tokenizer is not None:
        decode(tokens, tokenizer)
    total = segments[segment - 1].total
    return render(
        request,
        "tokens.html",
        {
            "job_id": job_id,
            "segment": segment,
            "tokens": tokens,
            "next": start + TOKENS_PER_CHUNK if start + TOKENS_PER_CHUNK < total else None,
        },
    )


# ---------------------------------------------------------------------- installation
async def _sign_in(request: Request, _exc: Exception) -> Response:
    if request.headers.get("hx-request"):
        return HTMLResponse("sign in again", status_code=401, headers={"HX-Redirect": "/ui/signin"})
    return render(request, "signin.html", {"error": None}, status_code=401)


async def _admin_only(request: Request, _exc: Exception) -> Response:
    return render(request, "forbidden.html", {}, status_code=403)


def install(app: FastAPI) -> None:
    """Serve the console on `app`: its pages, its static files, its sign-in answer."""
    app.include_router(open_router)
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    app.add_exception_handler(SignInRequired, _sign_in)
    app.add_exception_handler(AdminRequired, _admin_only)
