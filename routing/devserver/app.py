"""The HTTP API of the development server: the inference routes rollserve's clients use.

vLLM's OpenAI-compatible server: `POST /v1/completions`, `POST /tokenize`, `POST /detokenize`,
`GET /v1/models`, `GET /health`, `GET /metrics` and `GET /version`, with vLLM's field names,
defaults, validation messages and error bodies; vLLM's tokens-in/tokens-out
`POST /inference/v1/generate` and its `POST /inference/v1/abort_requests`. SGLang's native
API: `POST /generate` and `POST /abort_request` (SGLang's `/tokenize`, `/v1/models` and
`/health` are the routes above; `/detokenize` answers both dialects: `text` to a request with
SGLang's `skip_special_tokens`, `prompt` otherwise, as vLLM).

One completion runs on the engine at a time, in a worker thread, so the event loop keeps
answering (health checks, tokenization, metrics, aborts) while a model call runs. As in vLLM,
a client that disconnects aborts its request; SGLang's `/abort_request` aborts the request
with that `rid`, vLLM's `/inference/v1/abort_requests` those it names (`generate-tokens-<id>`).
Either stops the generation before its next token and is counted in
`vllm:request_success_total{finished_reason="abort"}`. A scripted delay counts as waiting.

New weights are loaded while the server runs through SGLang's `/update_weights_from_disk` or
vLLM's development-mode `/pause`, `/collective_rpc` (`reload_weights`, and the
`rollserve_load_weights` of rollserve's vLLM worker extension), `/reset_prefix_cache` and
`/resume` (`routing/devserver/weights.py`); every generation route passes its gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from routing.devserver.engine import Engine
from routing.devserver.guard import GuardEveryRoute
from routing.devserver.protocol import (
    AbortRequest,
    AbortRequestsRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    RequestError,
    SGLangGenerateRequest,
    error_body,
)
from routing.devserver.server import VERSION, DevServer, validation_message
from routing.devserver.weights import WeightUpdater, attach_weight_routes

T = TypeVar("T")


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (vLLM's `with_cancellation`).

    Returns None when the client went away.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestError(validation_message(e)) from e


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The development server's FastAPI app, serving `engine` with vLLM's HTTP API; with an
    `api_key`, every route but `/health` and `/ping` asks for it as a bearer token
    (`routing.devserver.guard`)."""
    server = DevServer(engine)
    updater = WeightUpdater(server)
    gate = updater.gate
    app = FastAPI(title="rollserve development inference server", version=VERSION)
    if api_key:
        app.add_middleware(GuardEveryRoute, api_key=api_key)
    app.state.devserver = server
    app.state.weights = updater

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", 500), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # vLLM answers malformed bodies with a 400, not FastAPI's 422.
        return JSONResponse(error_body(validation_message(exc), 400), status_code=400)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        body = await _cancel_on_disconnect(
            request, gate.run(server.completions(req, request.headers.get("X-Request-Id")))
        )
        if body is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if not req.stream:
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            # One event with the whole completion, as vLLM sends when it cannot stream.
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/inference/v1/generate")
    async def generate_tokens(request: Request) -> Response:
        req: GenerateRequest = await _parse(request, GenerateRequest)
        body = await _cancel_on_disconnect(
            request, gate.run(server.generate_tokens(req, request.headers.get("X-Request-Id")))
        )
        return Response(status_code=499) if body is None else JSONResponse(body)

    @app.post("/generate")
    async def sglang_generate(request: Request) -> Response:
        req: SGLangGenerateRequest = await _parse(request, SGLangGenerateRequest)
        body = await _cancel_on_disconnect(request, gate.run(server.sglang_generate(req)))
        return Response(status_code=499) if body is None else JSONResponse(body)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req: AbortRequest = await _parse(request, AbortRequest)
        server.abort(req.rid, abort_all=req.abort_all)
        return Response(status_code=200)

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(request: Request) -> Response:
        # vLLM's (served with /inference/v1/generate): ids as that route names its requests.
        req: AbortRequestsRequest = await _parse(request, AbortRequestsRequest)
        for request_id in req.request_ids:
            server.abort(request_id)
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise RequestError(f"The request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError("The request body must be a JSON object")
        return JSONResponse(server.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req: DetokenizeRequest = await _parse(request, DetokenizeRequest)
        return JSONResponse(server.detokenize(req))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VERSION})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    attach_weight_routes(app, updater)
    return app
