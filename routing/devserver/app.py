"""The HTTP API of the development server: vLLM's OpenAI-compatible routes rollserve uses.

`POST /v1/completions`, `POST /tokenize`, `POST /detokenize`, `GET /v1/models`, `GET /health`,
`GET /metrics` and `GET /version`, with vLLM's field names, defaults, validation messages and
error bodies. One completion runs on the engine at a time, in a worker thread, so the event
loop keeps answering (health checks, tokenization, metrics) while a model call runs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from routing.devserver.engine import Engine, Generation, SamplingParams
from routing.devserver.metrics import ServerMetrics
from routing.devserver.protocol import (
    LOGPROB_FLOOR,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    tool_for_template,
)

VERSION = "0.0.0+rollserve.dev"
"""What `GET /version` reports: this is not vLLM, only its API."""


def _validation_message(error: ValidationError | RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(x) for x in item.get("loc", ()) if x != "body")
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "invalid request"


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
        raise RequestError(_validation_message(e)) from e


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template.

    Text parts of list contents are joined with newlines, and JSON-string tool call arguments
    are parsed into objects (templates render them with `tojson`).
    """
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            m["content"] = "\n".join(t for t in texts if isinstance(t, str))
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if not args:
                    function["arguments"] = {}
                elif isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise RequestError(
                            f"tool call arguments are not valid JSON: {e}", param="messages"
                        ) from e
                call["function"] = function
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


class DevServer:
    """Request handling around one engine; `create_app` exposes it over HTTP."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine.served_model_name)
        self.created = int(time.time())
        self._lock = asyncio.Lock()

    # --- validation shared by the routes

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.served_model_name:
            raise RequestError(f"The model `{model}` does not exist.", 404, param="model")

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise RequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        items: list[Any]
        if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        prompts = []
        for item in items:
            ids = (
                self.engine.encode(item, add_special_tokens=req.add_special_tokens)
                if isinstance(item, str)
                else list(item)
            )
            if not ids:
                raise RequestError("The prompt cannot be empty.", param="prompt")
            bad = [i for i in ids if i >= self.engine.vocab_size]
            if bad:
                raise RequestError(
                    f"Token id {bad[0]} is out of vocabulary (size {self.engine.vocab_size}).",
                    param="prompt",
                )
            prompts.append(ids)
        return prompts

    def _sampling(self, req: CompletionRequest) -> SamplingParams:
        if req.echo:
            raise RequestError("`echo` is not supported by the development server.", param="echo")
        if req.prompt_logprobs is not None:
            raise RequestError(
                "`prompt_logprobs` is not supported by the development server.",
                param="prompt_logprobs",
            )
        if req.n < 1:
            raise RequestError(f"n must be at least 1, got {req.n}.", param="n")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens < 1:
            raise RequestError(
                f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens"
            )
        defaults = self.engine.default_sampling
        temperature = (
            defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
        )
        if temperature < 0:
            raise RequestError(
                f"temperature must be non-negative, got {temperature}.", param="temperature"
            )
        top_p = defaults.get("top_p", 1.0) if req.top_p is None else req.top_p
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        top_k = int(defaults.get("top_k", 0) if req.top_k is None else req.top_k)
        top_k = 0 if top_k == -1 else top_k
        if top_k < 0:
            raise RequestError(
                f"top_k must be 0 (disable), or at least 1, got {top_k}.", param="top_k"
            )
        if req.logprobs is not None and req.logprobs < 0:
            raise RequestError("`logprobs` must be a positive value or -1.", param="logprobs")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise RequestError("stop cannot contain an empty string.", param="stop")
        logprobs = req.logprobs
        if logprobs == -1:
            logprobs = self.engine.vocab_size
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )

    def _check_length(self, prompt: list[int], max_tokens: int) -> None:
        # vLLM reserves max_tokens of the context for the output and refuses longer prompts.
        limit = self.engine.max_model_len
        if max_tokens > limit:
            raise RequestError(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param="max_tokens",
            )
        if len(prompt) > limit - max_tokens:
            raise RequestError(
                f"You passed {len(prompt)} input tokens and requested {max_tokens} output "
                f"tokens. However, the model's context length is only {limit} tokens, "
                f"resulting in a maximum input length of {limit - max_tokens} tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )

    # --- completions

    async def _run(self, prompt: list[int], params: SamplingParams) -> Generation:
        plan = self.engine.plan(prompt, params)
        if plan.delay > 0:
            await asyncio.sleep(plan.delay)
        if plan.error_status is not None:
            raise RequestError(
                f"Scripted failure ({plan.error_status}) of the development server.",
                plan.error_status,
            )
        waiting, running = self.metrics.gauge("waiting"), self.metrics.gauge("running")
        waiting.inc()
        try:
            await self._lock.acquire()
        finally:
            waiting.dec()
        running.inc()
        self.metrics.record_prompt(prompt)
        work = asyncio.ensure_future(asyncio.to_thread(self.engine.generate, plan))

        def _release(_: object) -> None:
            running.dec()
            self._lock.release()

        # The lock is held until the model call really ends: a cancelled request cannot stop
        # its thread, and the next one must not run beside it.
        work.add_done_callback(_release)
        result = await asyncio.shield(work)
        self.metrics.record_finished(prompt, result.token_ids, result.finish_reason)
        return result

    def _logprobs_body(self, gen: Generation, k: int) -> dict[str, Any]:
        tokens: list[str] = []
        offsets: list[int] = []
        top: list[dict[str, float] | None] = []
        position = 0
        for i, token_id in enumerate(gen.token_ids):
            token = self.engine.token_str(token_id)
            tokens.append(token)
            offsets.append(position)
            position += len(token)
            entries = gen.top_logprobs[i] if gen.top_logprobs is not None else []
            top.append(
                {self.engine.token_str(t): max(lp, LOGPROB_FLOOR) for t, lp in entries[: k + 1]}
            )
        return {
            "text_offset": offsets,
            "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in gen.logprobs],
            "tokens": tokens,
            "top_logprobs": top,
        }

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        """A vLLM `CompletionResponse` for the request."""
        self.check_model(req.model)
        params = self._sampling(req)
        prompts = self._prompts(req)
        for prompt in prompts:
            self._check_length(prompt, params.max_tokens)
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = 0
        for prompt in prompts:
            for i in range(req.n):
                sample_params = params
                if params.seed is not None and i > 0:
                    sample_params = replace(params, seed=params.seed + i)
                gen = await self._run(prompt, sample_params)
                choices.append(
                    {
                        "index": len(choices),
                        "text": gen.text,
                        "logprobs": (
                            self._logprobs_body(gen, params.logprobs or 0)
                            if params.logprobs is not None
                            else None
                        ),
                        "finish_reason": gen.finish_reason,
                        "stop_reason": gen.stop_reason,
                        "token_ids": gen.token_ids if req.return_token_ids else None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt if req.return_token_ids else None,
                    }
                )
                completion_tokens += len(gen.token_ids)
            prompt_tokens += len(prompt)
        return {
            "id": f"cmpl-{req.request_id or uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.engine.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
            },
            "kv_transfer_params": None,
        }

    # --- tokenization

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A vLLM `TokenizeResponse` for a text prompt or chat messages."""
        kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:
            raise RequestError(_validation_message(e)) from e
        if isinstance(parsed, TokenizeCompletionRequest):
            self.check_model(parsed.model)
            ids = self.engine.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
            return self._tokenize_response(ids, bool(parsed.return_token_strs))
        chat: TokenizeChatRequest = parsed
        self.check_model(chat.model)
        if chat.add_generation_prompt and chat.continue_final_message:
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        messages = _normalize_messages(chat.messages)
        tools = None if chat.tools is None else [tool_for_template(t) for t in chat.tools]
        try:
            ids = self.engine.render_chat(
                messages,
                add_generation_prompt=chat.add_generation_prompt,
                tools=tools,
                continue_final_message=chat.continue_final_message,
                add_special_tokens=chat.add_special_tokens,
                chat_template=chat.chat_template,
                chat_template_kwargs=chat.chat_template_kwargs,
            )
        except Exception as e:  # the template failed on these messages: the caller's input
            raise RequestError(f"The chat template failed: {type(e).__name__}: {e}") from e
        return self._tokenize_response(ids, bool(chat.return_token_strs))

    def _tokenize_response(self, ids: list[int], with_strs: bool) -> dict[str, Any]:
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if with_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """A vLLM `DetokenizeResponse`: the text of the ids, special tokens kept."""
        self.check_model(req.model)
        bad = [i for i in req.tokens if i >= self.engine.vocab_size]
        if bad:
            raise RequestError(f"Token id {bad[0]} is out of vocabulary.", param="tokens")
        return {"prompt": self.engine.decode(req.tokens)}

    def models(self) -> dict[str, Any]:
        """A vLLM `ModelList` with the one served model."""
        name = self.engine.served_model_name
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "vllm",
                    "root": str(self.engine.model_dir),
                    "parent": None,
                    "max_model_len": self.engine.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": self.created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }


def create_app(engine: Engine) -> FastAPI:
    """The development server's FastAPI app, serving `engine` with vLLM's HTTP API."""
    server = DevServer(engine)
    app = FastAPI(title="rollserve development inference server", version=VERSION)
    app.state.devserver = server

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", 500), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # vLLM answers malformed bodies with a 400, not FastAPI's 422.
        return JSONResponse(error_body(_validation_message(exc), 400), status_code=400)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        body = await server.completions(req)
        if not req.stream:
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            # One event with the whole completion, as vLLM sends when it cannot stream.
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

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

    return app
