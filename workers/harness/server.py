"""The harness endpoint's HTTP app: the OpenAI and Anthropic routes over one job lookup.

OpenAI SDKs take a base URL ending in `/v1` and Anthropic SDKs one without it, so one app at
the root serves both: `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages`
and `GET /v1/models`. The key (`Authorization: Bearer KEY` or `x-api-key: KEY`) picks the
job's `Endpoint`. Every error, including bad JSON, an oversized body, an unknown route or a
crash, is answered in the API's own error shape (Anthropic's on the Anthropic routes and for
clients sending `anthropic-version`), never as a bare 500 or a stack trace.

A streaming request is generated in full before its first event is sent, so an error from
`generate` (a spent budget, a context too long, a cancelled job) is answered as a normal error
response, with its status.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from workers.harness import anthropic_messages, openai_chat, openai_responses
from workers.harness.wire import ApiError, ChatRequest, ChatResult

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
SHUTDOWN_SECONDS = 5.0
"""How long `stop_server` lets calls in flight finish before cancelling them."""


class Endpoint(Protocol):
    """One job's model, as the endpoint serves it."""

    @property
    def model(self) -> str:
        """The model name the endpoint lists and answers with."""
        ...

    async def generate(self, request: ChatRequest) -> ChatResult:
        """Answer `request`; raises `ApiError` for a spent budget, a context too long, a job
        no longer running."""
        ...


FindEndpoint = Callable[[str], Awaitable[Endpoint | None]]
"""An API key → its job's endpoint, or None when the key opens nothing (any more)."""


@dataclass(frozen=True)
class _Shape:
    """One API's translations, as the handlers use them."""

    parse_request: Callable[[Any], ChatRequest]
    response: Callable[[ChatResult, ChatRequest], dict[str, Any]]
    stream_events: Callable[[ChatResult, ChatRequest], list[str]]
    error_body: Callable[[ApiError], dict[str, Any]]


_CHAT = _Shape(
    openai_chat.parse_request,
    openai_chat.response,
    openai_chat.stream_events,
    openai_chat.error_body,
)
_RESPONSES = _Shape(
    openai_responses.parse_request,
    openai_responses.response,
    openai_responses.stream_events,
    openai_responses.error_body,
)
_MESSAGES = _Shape(
    anthropic_messages.parse_request,
    anthropic_messages.response,
    anthropic_messages.stream_events,
    anthropic_messages.error_body,
)

_FIND_ENDPOINT = web.AppKey[FindEndpoint]("find_endpoint")

# Kinds worth retrying; for the others the SDKs are told not to (they would retry a 409 or a
# spent budget's 429 on their own).
_RETRYABLE = {"rate_limit", "server"}


def _error_shape(request: web.Request) -> _Shape:
    """Anthropic's shape on its routes and for its clients (they send `anthropic-version`),
    OpenAI's otherwise."""
    anthropic = request.path.startswith("/v1/messages") or "anthropic-version" in request.headers
    return _MESSAGES if anthropic else _CHAT


def _error_response(request: web.Request, err: ApiError) -> web.Response:
    headers = {} if err.kind in _RETRYABLE else {"x-should-retry": "false"}
    body = _error_shape(request).error_body(err)
    return web.json_response(body, status=err.status, headers=headers)


def key_fingerprint(key: str) -> str:
    """What the logs may show of an API key: a short prefix of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def _api_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


async def endpoint_of(request: web.Request) -> Endpoint:
    """The endpoint the request's key opens; `ApiError` (401) when none."""
    key = _api_key(request)
    if key is None:
        raise ApiError("authentication", "no API key: send `Authorization: Bearer KEY`")
    endpoint = await request.app[_FIND_ENDPOINT](key)
    if endpoint is None:
        log.info("refused key %s on %s", key_fingerprint(key), request.path)
        raise ApiError("authentication", "invalid API key, or its job is no longer running")
    return endpoint


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


async def json_body(request: web.Request) -> Any:
    """The request's body as JSON (strict: no NaN or Infinity); `ApiError` otherwise."""
    body = await request.read()  # over the app's `client_max_size`: HTTPRequestEntityTooLarge
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError("invalid_request", f"the body is not valid JSON ({exc})") from None


def _generate_route(shape: _Shape) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        endpoint = await endpoint_of(request)
        chat = shape.parse_request(await json_body(request))
        result = await endpoint.generate(chat)
        log.debug(
            "%s: %d+%d tokens, %s",
            request.path,
            result.prompt_tokens,
            result.completion_tokens,
            result.finish_reason,
        )
        if not chat.stream:
            return web.json_response(shape.response(result, chat))
        events = "".join(shape.stream_events(result, chat))
        return web.Response(
            text=events,
            content_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    return handle


def _model_entry(model: str) -> dict[str, Any]:
    # Both SDKs' model objects at once: OpenAI's (`object`, `created`, `owned_by`) and
    # Anthropic's (`type`, `display_name`, `created_at`); each ignores the other's fields.
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "rollserve",
        "type": "model",
        "display_name": model,
        "created_at": "1970-01-01T00:00:00Z",
    }


async def _list_models(request: web.Request) -> web.Response:
    model = (await endpoint_of(request)).model
    return web.json_response(
        {
            "object": "list",
            "data": [_model_entry(model)],
            "has_more": False,
            "first_id": model,
            "last_id": model,
        }
    )


async def _get_model(request: web.Request) -> web.Response:
    model = (await endpoint_of(request)).model
    if request.match_info["model"] != model:
        raise ApiError("not_found", f"no model `{request.match_info['model']}` here")
    return web.json_response(_model_entry(model))


async def _count_tokens(request: web.Request) -> web.Response:
    await endpoint_of(request)
    raise ApiError("not_found", "token counting is not served by this endpoint")


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    """The router's and the body reader's refusals as errors of the API."""
    if exc.status == 404:
        return ApiError("not_found", f"no route {request.method} {request.path}")
    if exc.status == 405:
        return ApiError("method_not_allowed", f"{request.method} is not allowed on {request.path}")
    if exc.status == 413:
        return ApiError("too_large", exc.text or "the body is too large")
    return ApiError("invalid_request", exc.reason)


@web.middleware
async def _api_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as an error of the request's API; nothing escapes as a 500."""
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(request, err)
    except web.HTTPException as exc:
        return _error_response(request, _http_error(request, exc))
    except Exception:
        log.exception("harness endpoint failed on %s %s", request.method, request.path)
        return _error_response(request, ApiError("server", "the endpoint failed; try again"))


def make_app(
    find_endpoint: FindEndpoint, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> web.Application:
    """The endpoint's app: the routes of the module docstring, each key resolved by
    `find_endpoint`, bodies over `max_body_bytes` refused (413)."""
    app = web.Application(middlewares=[_api_errors], client_max_size=max_body_bytes)
    app[_FIND_ENDPOINT] = find_endpoint
    app.router.add_post("/v1/chat/completions", _generate_route(_CHAT))
    app.router.add_post("/v1/responses", _generate_route(_RESPONSES))
    app.router.add_post("/v1/messages", _generate_route(_MESSAGES))
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/v1/models/{model}", _get_model)
    return app


async def _start(
    app: web.Application, make_site: Callable[[web.AppRunner], web.BaseSite]
) -> web.AppRunner:
    # No access log (a line per model call; `_endpoint` logs refused keys). A call still
    # running at shutdown gets a few seconds, not aiohttp's minute: its job is over.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
    await runner.setup()
    try:
        await make_site(runner).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def serve_tcp(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` on `host:port` (port 0: a free one, read from `runner.addresses`)."""
    return await _start(app, lambda runner: web.TCPSite(runner, host, port))


async def serve_unix(app: web.Application, path: str) -> web.AppRunner:
    """Serve `app` on a Unix socket at `path` (a stale socket there is replaced)."""
    return await _start(app, lambda runner: web.UnixSite(runner, path))


async def stop_server(runner: web.AppRunner) -> None:
    """Stop serving: close the listeners and connections, and remove Unix socket files."""
    paths = [a for a in runner.addresses if isinstance(a, str)]
    await runner.cleanup()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
