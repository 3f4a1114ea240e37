"""Error answers of the gateway: their bodies as strict JSON, and their OpenAPI documentation.

Every error answer has the shape of `ErrorBody`: `{"detail": "why"}`, or for a refused field
`{"detail": [{"loc": [...], "msg": ..., "type": ...}]}`. A refused value is echoed in
`input`; since it may be what strict JSON cannot carry (NaN, a lone surrogate), it is echoed
as text then (`json_safe`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response

from core.schemas import ErrorBody

MAX_ECHO_CHARS = 1000
"""Longest string echoed back in an error; longer ones are cut."""
MAX_ECHO_DEPTH = 16
"""Deepest nesting echoed back in an error; deeper values are elided."""


def json_safe(value: Any, max_chars: int | None = None, depth: int = 0) -> Any:
    """`value` as strict JSON in UTF-8 can carry it: NaN and infinities as text (`"nan"`,
    `"inf"`), lone surrogates escaped (`"\\ud800"`), what is not JSON as its `str`; nesting
    past `MAX_ECHO_DEPTH` elided, and with `max_chars` longer strings cut."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        if max_chars is not None and len(value) > max_chars:
            value = value[:max_chars] + "…"
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, bytes):
        return json_safe(value.decode("utf-8", "backslashreplace"), max_chars, depth)
    if isinstance(value, dict | list | tuple) and depth >= MAX_ECHO_DEPTH:
        return "…"
    if isinstance(value, dict):
        return {
            str(json_safe(k, max_chars, depth + 1)): json_safe(v, max_chars, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [json_safe(v, max_chars, depth + 1) for v in value]
    return json_safe(str(value), max_chars, depth)


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 for a request that fails validation, with every echoed value JSON-safe
    (FastAPI's own handler fails on a NaN or a lone surrogate in the input it echoes) and the
    echoed input cut to `MAX_ECHO_CHARS` per string."""
    errors = [
        {
            key: json_safe(value, MAX_ECHO_CHARS if key == "input" else None)
            for key, value in error.items()
            if key != "url"
        }
        for error in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """FastAPI's answer to an HTTPException, except that a 405 lists in `Allow` the methods
    the OpenAPI document gives the path (Starlette lists those of the first route whose path
    matches). Where a literal path and a templated one both match (`/v1/backends/drain`,
    `/v1/backends/{backend_id}`), the path is the one with the fewest parameters, as in
    OpenAPI."""
    if exc.status_code == 405:
        methods = documented_methods(request)
        if methods:
            headers = {**(exc.headers or {}), "Allow": ", ".join(methods)}
            exc = HTTPException(exc.status_code, exc.detail, headers)
    return await http_exception_handler(request, exc)


def documented_methods(request: Request) -> list[str]:
    """The methods of the OpenAPI path that `request`'s path falls under; empty for none."""
    path = request.url.path
    best: tuple[int, list[str]] | None = None
    for template, operations in request.app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            parameters = template.count("{")
            if best is None or parameters < best[0]:
                best = (parameters, [m.upper() for m in operations if m.upper() in HTTP_METHODS])
    return best[1] if best else []


# ----------------------------------------------------------------------------- OpenAPI

DESCRIPTIONS: dict[int, str] = {
    400: "The body could not be read as JSON (malformed, a number too long, nested too deep).",
    401: "No bearer token, or a wrong one (`ROLLSERVE_API_TOKEN` is set).",
    403: "A tenant's token, where only the operator's (`ROLLSERVE_API_TOKEN`) may act.",
    404: "No such job, batch or backend (also for an id of a shape the service never makes).",
    413: "The body, a task in it, or the number of jobs it makes exceeds a configured limit.",
    422: "A field is missing or invalid: `detail` names it (`loc`) and says why.",
    429: "The submission would take its tenant past the quota of unfinished jobs.",
    503: "The job store or the broker (Redis) is unreachable or full.",
}

SUBMISSION_UNAVAILABLE = (
    "No inference backend is registered, or the job store or the broker (Redis) is "
    "unreachable, saturated or full: nothing was enqueued."
)


def error_responses(
    *codes: int, descriptions: dict[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the `ErrorBody` schema and
    its description from `DESCRIPTIONS` unless `descriptions` gives one."""
    return {
        code: {
            "model": ErrorBody,
            "description": (descriptions or DESCRIPTIONS).get(code, DESCRIPTIONS[code]),
        }
        for code in codes
    }


BODY = error_responses(400, 413, 422)
"""A route with a JSON body."""
BY_ID = error_responses(404, 422)
"""A route addressing one job, batch or backend by its id (FastAPI documents a 422 on every
route with parameters; this gives it the `ErrorBody` shape)."""
ADMIN = error_responses(403)
"""A route that changes the fleet: only the operator's token may call it."""
SUBMISSION = {
    **BODY,
    **error_responses(429, 503, descriptions={503: SUBMISSION_UNAVAILABLE}),
}
"""`POST /v1/rollouts` and `POST /v1/batches`."""


def links(**targets: tuple[str, str, str, str]) -> dict[str, dict[str, Any]]:
    """OpenAPI links of a response: name → (method, path, parameter, where in the body)."""
    return {
        name: {
            "operationRef": "#/paths/" + path.replace("~", "~0").replace("/", "~1") + f"/{method}",
            "parameters": {parameter: f"$response.body#{pointer}"},
        }
        for name, (method, path, parameter, pointer) in targets.items()
    }


JOB = "/v1/rollouts/{job_id}"
BATCH = "/v1/batches/{batch_id}"
ROLLOUT_LINKS = links(
    GetRollout=("get", JOB, "job_id", "/job_id"),
    CancelRollout=("delete", JOB, "job_id", "/job_id"),
)
"""Where the `job_id` of an accepted rollout leads."""
BATCH_LINKS = links(
    GetBatch=("get", BATCH, "batch_id", "/batch_id"),
    CancelBatch=("delete", BATCH, "batch_id", "/batch_id"),
    GetFirstRollout=("get", JOB, "job_id", "/jobs/0"),
)
"""Where the ids of an accepted batch lead."""
