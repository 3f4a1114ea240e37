"""The development server's inference engine behind vLLM's and SGLang's HTTP APIs: request
validation with vLLM's messages, completions (one at a time on the engine, in a worker
thread), tokens in and tokens out, SGLang's native generate, tokenization and the model list.
`routing/devserver/app.py` puts it behind the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from routing.chat import template_messages
from routing.devserver.engine import Engine, Generation, Plan, SamplingParams
from routing.devserver.metrics import ServerMetrics
from routing.devserver.protocol import (
    LOGPROB_FLOOR,
    SAMPLING_EPS,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    RequestError,
    SGLangGenerateRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenSamplingParams,
    tool_for_template,
)

VERSION = "0.0.0+rollserve.dev"
"""What `GET /version` reports: this is not vLLM, only its API."""


def validation_message(error: ValidationError | RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(x) for x in item.get("loc", ()) if x != "body")
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "invalid request"


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the chat template (`routing.chat.template_messages`)."""
    try:
        return template_messages(messages)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from e


class _Job:
    """A request on its way through the server, which an abort can stop."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._wake = asyncio.Event()

    @property
    def aborted(self) -> bool:
        return self.plan.cancel.is_set()

    def abort(self) -> None:
        self.plan.cancel.set()
        self._wake.set()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less if aborted meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)


class DevServer:
    """Request handling around one engine; `create_app` exposes it over HTTP."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine.served_model_name)
        self.created = int(time.time())
        self._lock = asyncio.Lock()
        self._jobs: dict[str, _Job] = {}

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

    def _sampling(self, req: CompletionRequest | TokenSamplingParams) -> SamplingParams:
        if getattr(req, "echo", False):
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
        if not math.isfinite(temperature):
            raise RequestError(
                f"temperature must be a non-negative finite number, got {temperature}.",
                param="temperature",
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
        if req.logprobs is not None and req.logprobs > self.engine.vocab_size:
            raise RequestError(
                f"Requested sample logprobs of {req.logprobs}, which is greater than the "
                f"vocabulary size {self.engine.vocab_size}.",
                param="logprobs",
            )
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

    async def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> Generation:
        """Run one completion; it can be aborted by `abort(request_id)` or by cancelling."""
        arrived = time.monotonic()
        plan = self.engine.plan(prompt, params)
        job = _Job(plan)
        if request_id is not None:
            self._jobs[request_id] = job
        waiting, running = self.metrics.gauge("waiting"), self.metrics.gauge("running")
        waiting.inc()
        queued = True
        try:
            if plan.delay > 0:
                await job.sleep(plan.delay)
            if job.aborted:
                self.metrics.record_aborted()
                return self._aborted()
            if plan.error_status is not None:
                raise RequestError(
                    f"Scripted failure ({plan.error_status}) of the development server.",
                    plan.error_status,
                )
            await self._lock.acquire()
            waiting.dec()
            queued = False
            if job.aborted:
                self._lock.release()
                self.metrics.record_aborted()
                return self._aborted()
            running.inc()
            cached = self.metrics.record_prompt(prompt, cache_salt)
            work = asyncio.ensure_future(asyncio.to_thread(self.engine.generate, plan))

            def _release(done: asyncio.Future[Generation]) -> None:
                running.dec()
                self._lock.release()
                if not done.cancelled() and done.exception() is None:
                    result = done.result()
                    self.metrics.record_finished(
                        prompt,
                        result.token_ids,
                        result.finish_reason,
                        cache_salt,
                        seconds=time.monotonic() - arrived,
                    )

            # The lock is held until the model call really ends: a cancelled request stops
            # its thread at the next token, and the next one must not run beside it.
            work.add_done_callback(_release)
            try:
                result = await asyncio.shield(work)
            except asyncio.CancelledError:
                job.abort()
                raise
            return replace(result, cached_tokens=cached)
        except asyncio.CancelledError:
            if queued:
                self.metrics.record_aborted()
            raise
        finally:
            if queued:
                waiting.dec()
            if request_id is not None and self._jobs.get(request_id) is job:
                del self._jobs[request_id]

    def _aborted(self) -> Generation:
        return Generation(
            token_ids=[],
            logprobs=[],
            top_logprobs=[],
            text="",
            finish_reason="abort",
            stop_reason=None,
        )

    def abort(self, request_id: str, *, abort_all: bool = False) -> int:
        """Abort the running request named `request_id` (or all); returns how many."""
        jobs = list(self._jobs.values()) if abort_all else [self._jobs.get(request_id)]
        aborted = [job for job in jobs if job is not None and not job.aborted]
        for job in aborted:
            job.abort()
        return len(aborted)

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

    async def completions(
        self, req: CompletionRequest, header_request_id: str | None = None
    ) -> dict[str, Any]:
        """A vLLM `CompletionResponse` for the request (named `cmpl-<X-Request-Id or
        request_id>`, as vLLM names it)."""
        self.check_model(req.model)
        base_id = header_request_id or req.request_id or uuid.uuid4().hex
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
                gen = await self._run(
                    prompt,
                    sample_params,
                    cache_salt=req.cache_salt,
                    request_id=f"cmpl-{base_id}",
                )
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
            "id": f"cmpl-{base_id}",
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

    # --- vLLM's tokens in, tokens out

    async def generate_tokens(
        self, req: GenerateRequest, header_request_id: str | None = None
    ) -> dict[str, Any]:
        """A vLLM `GenerateResponse` for a `POST /inference/v1/generate` request."""
        self.check_model(req.model)
        if req.stream:
            raise RequestError("Streaming is not supported by the development server.")
        prompt = list(req.token_ids)
        self._check_vocab(prompt, "token_ids")
        limit = self.engine.max_model_len
        if len(prompt) >= limit:
            raise RequestError(
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                f"length of {limit}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens.",
                param="token_ids",
            )
        sampling = req.sampling_params
        if "max_tokens" not in (sampling.model_fields_set or set()):
            sampling = sampling.model_copy(update={"max_tokens": limit - len(prompt)})
        params = self._sampling(sampling)
        request_id = f"generate-tokens-{header_request_id or req.request_id or uuid.uuid4().hex}"
        gen = await self._run(prompt, params, cache_salt=req.cache_salt, request_id=request_id)
        logprobs = None
        if params.logprobs is not None:
            content = []
            for i, token_id in enumerate(gen.token_ids):
                entries = gen.top_logprobs[i] if gen.top_logprobs is not None else []
                top = [
                    {"token": f"token_id:{t}", "logprob": max(lp, LOGPROB_FLOOR), "bytes": None}
                    for t, lp in entries[: max(params.logprobs, 1)]
                ]
                content.append(
                    {
                        "token": f"token_id:{token_id}",
                        "logprob": max(gen.logprobs[i], LOGPROB_FLOOR),
                        "bytes": None,
                        "top_logprobs": top,
                    }
                )
            logprobs = {"content": content}
        return {
            "request_id": request_id,
            "model": self.engine.served_model_name,
            "created": int(time.time()),
            "prompt_token_ids": prompt if req.return_token_ids else None,
            "choices": [
                {
                    "index": 0,
                    "logprobs": logprobs,
                    "finish_reason": gen.finish_reason,
                    "token_ids": gen.token_ids,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(gen.token_ids),
                "completion_tokens": len(gen.token_ids),
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }

    def _check_vocab(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if i >= self.engine.vocab_size]
        if bad:
            raise RequestError(
                f"Token id {bad[0]} is out of vocabulary (size {self.engine.vocab_size}).",
                param=param,
            )

    # --- SGLang's native API

    def _sglang_sampling(self, req: SGLangGenerateRequest, prompt_len: int) -> SamplingParams:
        p = req.sampling_params
        if p.n != 1:
            raise RequestError("n > 1 is not supported by the development server.")
        temperature = 1.0 if p.temperature is None else p.temperature
        if not math.isfinite(temperature) or temperature < 0:
            raise RequestError(
                f"temperature must be a non-negative finite number, got {temperature}."
            )
        top_p = 1.0 if p.top_p is None else p.top_p
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
        top_k = -1 if p.top_k is None else p.top_k
        if top_k < 1 and top_k != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if req.return_logprob and (req.top_logprobs_num or 0) > self.engine.vocab_size:
            raise RequestError(
                f"top_logprobs_num {req.top_logprobs_num} is greater than the vocabulary size "
                f"{self.engine.vocab_size}."
            )
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise RequestError(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({limit} tokens)."
            )
        max_new = limit - prompt_len if p.max_new_tokens is None else p.max_new_tokens
        if max_new < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
        if prompt_len + max_new > limit:
            raise RequestError(
                "Requested token count exceeds the model's maximum context length of "
                f"{limit} tokens. You requested a total of {prompt_len + max_new} tokens: "
                f"{prompt_len} tokens from the input messages and {max_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        return SamplingParams(
            max_tokens=max(1, max_new),
            temperature=0.0 if temperature < SAMPLING_EPS else temperature,
            top_p=top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=p.sampling_seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(p.stop_token_ids or []),
            include_stop_str_in_output=p.no_stop_trim,
            skip_special_tokens=p.skip_special_tokens,
            ignore_eos=p.ignore_eos,
            logprobs=(req.top_logprobs_num or 0) if req.return_logprob else None,
        )

    def _sglang_finish(self, gen: Generation, params: SamplingParams) -> dict[str, Any]:
        if gen.finish_reason == "length":
            return {"type": "length", "length": len(gen.token_ids)}
        if gen.finish_reason == "abort":
            return {"type": "abort", "message": "Abort before the request finished."}
        matched = gen.stop_reason
        if matched is None and gen.token_ids:
            matched = gen.token_ids[-1]  # SGLang names the EOS id it matched
        return {"type": "stop", "matched": matched}

    async def sglang_generate(self, req: SGLangGenerateRequest) -> dict[str, Any]:
        """SGLang's `/generate` answer: `{"text", "output_ids", "meta_info"}`."""
        started = time.monotonic()
        if req.stream:
            raise RequestError("Streaming is not supported by the development server.")
        if req.input_ids is not None:
            prompt = list(req.input_ids)
        elif req.text is not None:
            prompt = self.engine.encode(req.text)
        else:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if not prompt:
            raise RequestError("input_ids cannot be empty.")
        self._check_vocab(prompt, "input_ids")
        params = self._sglang_sampling(req, len(prompt))
        rid = req.rid or uuid.uuid4().hex
        gen = await self._run(prompt, params, cache_salt=req.cache_salt or None, request_id=rid)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": self._sglang_finish(gen, params),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(gen.token_ids),
            "cached_tokens": gen.cached_tokens,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [max(lp, LOGPROB_FLOOR), token_id, None]
                for lp, token_id in zip(gen.logprobs, gen.token_ids, strict=True)
            ]
        meta["e2e_latency"] = time.monotonic() - started
        return {"text": gen.text, "output_ids": gen.token_ids, "meta_info": meta}

    # --- tokenization

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A vLLM `TokenizeResponse` for a text prompt or chat messages."""
        kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:
            raise RequestError(validation_message(e)) from e
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
        """The text of the ids: vLLM's `DetokenizeResponse` (`prompt`, special tokens kept),
        or SGLang's (`text`) for a request in SGLang's dialect, told by its
        `skip_special_tokens` field (which vLLM's request does not have)."""
        self.check_model(req.model)
        bad = [i for i in req.tokens if i >= self.engine.vocab_size]
        if bad:
            raise RequestError(f"Token id {bad[0]} is out of vocabulary.", param="tokens")
        text = self.engine.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
        if "skip_special_tokens" in req.model_fields_set:
            return {"text": text}
        return {"prompt": text}

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
