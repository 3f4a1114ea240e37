"""`/v1/backends`: the inference servers jobs are assigned to, their drain/resume for weight
updates, and the weight update itself (`POST /v1/backends/update_weights`).

The fleet is the operator's: registering, replacing, draining, resuming and deleting backends
and pushing weights need the operator's token (`ROLLSERVE_API_TOKEN`; a tenant's answers 403).
Waits for a drain hold no thread of the gateway (`api.waits`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from fastapi import APIRouter, Depends, HTTPException, Query, Response

from api.deps import require_admin, services
from api.errors import ADMIN, BODY, BY_ID, error_responses
from api.service import RequestError, Services
from api.waits import await_idle
from core.schemas import (
    Backend,
    BackendSpec,
    BackendWeightUpdate,
    ErrorBody,
    ResumeRequest,
    WeightUpdateReport,
    WeightUpdateRequest,
)
from core.settings import IPNetwork, Settings
from routing.addresses import BackendAddressError, check_backend_url
from routing.pool import BackendPool
from routing.sglang import TokenizerRefused, check_tokenizer_name, tokenizer_roots
from routing.vllm import bearer
from routing.weights import WeightUpdateError, load_weights

router = APIRouter(prefix="/v1/backends", tags=["backends"])
ADMIN_ONLY = [Depends(require_admin)]

MAX_DRAIN_WAIT = 3600.0
MODELS_LIMIT = 1024 * 1024
"""Most bytes of a `GET /v1/models` answer read at registration; a longer one is refused."""

URL_LOC = ["body", "url"]
UNLIKE_OPENAI = "does not answer like an OpenAI-compatible /v1/models"


def check_address(spec: BackendSpec, networks: tuple[IPNetwork, ...]) -> None:
    """Refuse a backend whose host does not resolve, or resolves to an address outside the
    allowed networks (`ROLLSERVE_BACKEND_NETWORKS`; link-local and cloud metadata addresses
    only when listed)."""
    try:
        check_backend_url(spec.url, networks)
    except BackendAddressError as exc:
        raise RequestError(422, str(exc), URL_LOC) from None


def check_tokenizer(spec: BackendSpec, settings: Settings) -> None:
    """Refuse an SGLang backend whose tokenizer (its `tokenizer`, else its `model`, which the
    workers then load as one) names a local path outside `ROLLSERVE_TOKENIZER_ROOTS`, or
    anything but a hub id (`routing.sglang.check_tokenizer_name`)."""
    if spec.kind != "sglang":
        return
    field, name = ("tokenizer", spec.tokenizer) if spec.tokenizer else ("model", spec.model)
    try:
        check_tokenizer_name(name, tokenizer_roots(settings))
    except TokenizerRefused as exc:
        hint = "" if field == "tokenizer" else " (it names the tokenizer: set `tokenizer`)"
        raise RequestError(422, f"{exc}{hint}", ["body", field]) from None


def _fetch_models(url: str, timeout: float, api_key: str | None = None) -> bytes:
    """The body of `GET url` (with the backend's `api_key` as a bearer token), at most
    `MODELS_LIMIT` bytes, within about `timeout` seconds in all; a RequestError saying what
    went wrong, never what the server sent."""
    deadline = time.monotonic() + timeout
    where = f"GET {url}"
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False) as client,
            client.stream(
                "GET", url, headers={"Accept-Encoding": "identity", **bearer(api_key)}
            ) as answer,
        ):
            if answer.status_code == 401:
                why = "refused the api_key given" if api_key else "asks for an api_key"
                raise RequestError(422, f"{where} answered HTTP 401: it {why}", ["body", "api_key"])
            if answer.status_code != 200:
                raise RequestError(
                    422, f"{where} answered HTTP {answer.status_code}, not 200", URL_LOC
                )
            if answer.headers.get("content-encoding", "identity").lower() != "identity":
                raise RequestError(
                    422, f"{where} {UNLIKE_OPENAI}: a compressed body, not asked for", URL_LOC
                )
            body = bytearray()
            for chunk in answer.iter_raw():
                body += chunk
                if len(body) > MODELS_LIMIT:
                    raise RequestError(
                        422, f"{where} {UNLIKE_OPENAI}: more than {MODELS_LIMIT} bytes", URL_LOC
                    )
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the answer took too long")
            return bytes(body)
    except httpx.TimeoutException:
        raise RequestError(422, f"{where} did not answer within {timeout:g} s", URL_LOC) from None
    except httpx.TransportError:
        raise RequestError(
            422, f"{where} could not be reached (no connection, or it broke)", URL_LOC
        ) from None
    except RequestError:
        raise
    except Exception:  # httpx.InvalidURL, UnicodeError, ValueError: the URL cannot be requested
        raise RequestError(422, "the backend URL cannot be requested", URL_LOC) from None


def check_reachable(spec: BackendSpec, timeout: float = 5.0) -> int | None:
    """Ask the server for its models; refuse a backend that does not answer like an
    OpenAI-compatible `GET /v1/models` (vLLM and SGLang both serve it) or does not serve
    the model. Returns the model's context length when the answer has it (`max_model_len`
    on the model's entry, as vLLM and SGLang report it), else None.

    The errors say what is wrong with the answer, never what it held.
    """
    url = spec.url.rstrip("/") + "/v1/models"
    body = _fetch_models(url, timeout, spec.api_key)
    not_openai = RequestError(
        422,
        f'GET {url} {UNLIKE_OPENAI} (a JSON object whose "data" lists models, each with a '
        'string "id")',
        URL_LOC,
    )
    try:
        answer: Any = json.loads(body)
    except (ValueError, RecursionError):
        raise not_openai from None
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not all(
        isinstance(card, dict) and isinstance(card.get("id"), str) for card in cards
    ):
        raise not_openai
    card = next((card for card in cards if card["id"] == spec.model), None)
    if card is None:
        raise RequestError(
            422,
            f"the backend does not serve model {spec.model!r} (its GET /v1/models does not "
            "list it)",
            ["body", "model"],
        )
    length = card.get("max_model_len")
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length
    return None


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


@router.post(
    "",
    status_code=201,
    response_model=Backend,
    responses={**BODY, **ADMIN},
    dependencies=ADMIN_ONLY,
)
def register(
    spec: BackendSpec,
    verify: bool = Query(
        True,
        description="check that the server answers and serves the model (the address "
        "policy applies either way)",
    ),
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
    check_tokenizer(spec, svc.settings)
    check_address(spec, svc.settings.backend_network_list)
    max_model_len = check_reachable(spec) if verify else None
    return svc.pool.register(spec, max_model_len=max_model_len)


@router.get("", response_model=list[Backend])
def list_backends(svc: Services = Depends(services)) -> list[Backend]:
    return svc.pool.list()


@router.post(
    "/drain",
    response_model=list[Backend],
    responses={**error_responses(422), **ADMIN},
    dependencies=ADMIN_ONLY,
)
async def drain_all(wait: float = WAIT, svc: Services = Depends(services)) -> list[Backend]:
    """Assign nothing new to any backend; running requests finish and their jobs wait between
    turns until a backend is resumed. With `wait`, answers once every backend is idle."""

    def drain_every() -> list[str]:
        ids = svc.pool.ids()
        for backend_id in ids:
            svc.pool.drain(backend_id)
        return ids

    ids = await asyncio.to_thread(drain_every)
    return await await_idle(svc.pool, ids, min(wait, MAX_DRAIN_WAIT))


@router.post(
    "/resume", response_model=list[Backend], responses={**BODY, **ADMIN}, dependencies=ADMIN_ONLY
)
def resume_all(
    body: ResumeRequest | None = None, svc: Services = Depends(services)
) -> list[Backend]:
    """Every backend takes work again, optionally announcing the policy version it now holds."""
    version = body.policy_version if body else None
    for backend_id in svc.pool.ids():
        svc.pool.resume(backend_id, version)
    return svc.pool.list()


UPDATE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": description}
    for code, description in {
        404: "A backend named in `backends` is not registered: nothing was drained.",
        409: "No backend is registered: there is nothing to update.",
        502: "No backend took the weights (each stays drained): `detail` says why.",
    }.items()
}
"""The error answers of `POST /v1/backends/update_weights` besides a body's."""


async def update_one(
    pool: BackendPool, backend_id: str, body: WeightUpdateRequest
) -> BackendWeightUpdate:
    """Drain one backend, wait until no job holds it, load the weights, resume it with the
    policy version. On any failure it stays drained, and the answer says why."""
    began = time.monotonic()
    drain_seconds: float | None = None
    load_seconds: float | None = None

    def failed(error: str) -> BackendWeightUpdate:
        spent = time.monotonic() - began
        return BackendWeightUpdate(
            id=backend_id,
            ok=False,
            drain_seconds=spent if drain_seconds is None else drain_seconds,
            load_seconds=load_seconds,
            total_seconds=spent,
            error=error,
        )

    await asyncio.to_thread(pool.drain, backend_id)
    found = await await_idle(pool, [backend_id], min(body.timeout, MAX_DRAIN_WAIT))
    drain_seconds = time.monotonic() - began
    if not found:
        return failed("it was removed during the update")
    backend = found[0]
    if not backend.idle:
        return failed(
            f"{backend.in_flight} job(s) still held it after {body.timeout:g} s: not loaded"
        )
    try:
        load_seconds = await load_weights(
            backend, body.model_path, timeout=body.timeout, weight_version=str(body.policy_version)
        )
    except WeightUpdateError as exc:
        return failed(str(exc))
    if not await asyncio.to_thread(pool.resume, backend_id, body.policy_version, body.model_path):
        return failed("it was removed during the update (after loading)")
    return BackendWeightUpdate(
        id=backend_id,
        ok=True,
        drain_seconds=drain_seconds,
        load_seconds=load_seconds,
        total_seconds=time.monotonic() - began,
    )


@router.post(
    "/update_weights",
    response_model=WeightUpdateReport,
    responses={**BODY, **UPDATE_ERRORS, **ADMIN},
    dependencies=ADMIN_ONLY,
)
async def update_weights(
    body: WeightUpdateRequest, svc: Services = Depends(services)
) -> WeightUpdateReport:
    """Switch backends to new weights (all, or those named), all at once: each is drained,
    waits until no job holds it (running requests finish on the old weights; their jobs wait
    between turns), loads `model_path` (SGLang's `/update_weights_from_disk`; vLLM's
    development-mode endpoints, see `routing.weights`) and takes work again announcing
    `policy_version`. 200 with each backend's timings when at least one switched (`ok` false
    and `error` name any that did not: they stay drained); 502 when none did; 404 for an
    unknown id and 409 with no backend registered, before anything is drained."""
    pool = svc.pool
    if body.backends is None:
        ids = await asyncio.to_thread(pool.ids)
        if not ids:
            raise RequestError(409, "no backend is registered: there is nothing to update")
    else:
        ids = list(dict.fromkeys(body.backends))
        known = await asyncio.to_thread(lambda: [i for i in ids if pool.get(i) is not None])
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise HTTPException(
                status_code=404, detail=f"no backend with id {', '.join(map(repr, unknown))}"
            )
    results = list(await asyncio.gather(*(update_one(pool, i, body) for i in ids)))
    failures = [r for r in results if not r.ok]
    error = "; ".join(f"{r.id}: {r.error}" for r in failures) or None
    if failures and len(failures) == len(results):
        raise HTTPException(
            status_code=502,
            detail=f"no backend took the weights of {body.model_path!r} (they stay drained): "
            f"{error}",
        )
    return WeightUpdateReport(
        model_path=body.model_path,
        policy_version=body.policy_version,
        ok=not failures,
        backends=results,
        error=error,
    )


@router.get("/{backend_id}", response_model=Backend, responses=BY_ID)
def get_backend(backend_id: str, svc: Services = Depends(services)) -> Backend:
    return _known(svc.pool, backend_id)


@router.post(
    "/{backend_id}/drain",
    response_model=Backend,
    responses={**BY_ID, **ADMIN},
    dependencies=ADMIN_ONLY,
)
async def drain(backend_id: str, wait: float = WAIT, svc: Services = Depends(services)) -> Backend:
    """Assign nothing new to this backend; its jobs move to others after their running request.
    `idle` in the answer says when its weights can be swapped (with `wait`, once it is)."""

    def drain_one() -> None:
        if not svc.pool.drain(backend_id):
            _known(svc.pool, backend_id)

    await asyncio.to_thread(drain_one)
    backends = await await_idle(svc.pool, [backend_id], min(wait, MAX_DRAIN_WAIT))
    return backends[0] if backends else await asyncio.to_thread(_known, svc.pool, backend_id)


@router.post(
    "/{backend_id}/resume",
    response_model=Backend,
    responses={**BODY, **BY_ID, **ADMIN},
    dependencies=ADMIN_ONLY,
)
def resume(
    backend_id: str, body: ResumeRequest | None = None, svc: Services = Depends(services)
) -> Backend:
    """The backend takes work again, optionally announcing the policy version it now holds."""
    if not svc.pool.resume(backend_id, body.policy_version if body else None):
        _known(svc.pool, backend_id)
    return _known(svc.pool, backend_id)


@router.delete(
    "/{backend_id}", status_code=204, responses={**BY_ID, **ADMIN}, dependencies=ADMIN_ONLY
)
def remove(backend_id: str, svc: Services = Depends(services)) -> Response:
    if not svc.pool.remove(backend_id):
        raise HTTPException(status_code=404, detail=f"no backend with id {backend_id!r}")
    return Response(status_code=204)
