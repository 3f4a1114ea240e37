"""One job's endpoint: each request a harness sends is one model call of the job.

The request's messages are turned into ids by the job's `Conversation` (appended to the
sequence, or a new segment), the ids go to the engine through the job's routed policy (sticky
backend, policy version, drain and failover, cancellation, staleness), and the answer is
recorded as the ids the engine returned before the harness sees it, as text decoded from those
ids with its tool calls parsed out (`workers.harness.toolparsers`).

The job's budgets bound the harness as they bound the built-in loop: past `agent.max_turns`,
`agent.max_total_tokens`, `agent.max_seconds` or the model's context a request is refused
(`ApiError`, in the API's own shape: 429 for a budget, 400 `context_length_exceeded`), and a
call's `max_tokens` is cut to what is left (its finish reason then `length`). The first bound a
harness runs into becomes the job's `stop_reason`. Calls are served one at a time, in order.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from routing.pool import NoBackendError
from routing.protocol import Completion
from routing.vllm import BackendError
from workers.agent import Limits
from workers.conversation import Conversation, Templater
from workers.harness.toolparsers import Parsed, ToolParser
from workers.harness.wire import ApiError, ChatRequest, ChatResult, TokenLogprob
from workers.routed_policy import JobCancelled, StalePolicy
from workers.trajectory import TrajectoryBuilder


class RoutedModel(Templater, Protocol):
    """What the session needs of the job's routed policy (`workers.routed_policy`)."""

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion: ...

    async def max_model_len(self) -> int: ...

    async def detokenize(self, ids: list[int]) -> str: ...


class HarnessSession:
    """The job's side of its endpoint (the `Endpoint` the HTTP app serves)."""

    def __init__(
        self,
        job_id: str,
        policy: RoutedModel,
        limits: Limits,
        parser: ToolParser,
        *,
        model: str = "policy",
        on_turn: Callable[[TrajectoryBuilder], Awaitable[object] | None] = lambda _b: None,
    ) -> None:
        self.job_id = job_id
        self.policy = policy
        self.limits = limits
        self.parser = parser
        self.model = model
        self.on_turn = on_turn
        self.conversation = Conversation(policy)
        self.calls = 0
        self.refused = 0
        self.stop_reason: str | None = None
        """The first budget a request ran into, when one did."""
        self.failure: BaseException | None = None
        """What ended the job from inside a call (`JobCancelled`, `StalePolicy`): the stage
        stops the harness and handles it as the built-in loop's stage does."""
        self.failed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._context: int | None = None
        self._saving: Awaitable[object] | None = None
        self._replied_at: float | None = None
        self._token_text: dict[int, str] = {}

    @property
    def builder(self) -> TrajectoryBuilder | None:
        return self.conversation.builder

    async def generate(self, request: ChatRequest) -> ChatResult:
        """Serve one call; `ApiError` when it is refused or the job cannot go on."""
        async with self._lock:
            await self.flush()
            try:
                return await self._generate(request)
            except ApiError:
                self.refused += 1
                raise

    async def flush(self) -> None:
        """Wait for the last save to land."""
        saving, self._saving = self._saving, None
        if saving is not None and inspect.isawaitable(saving):
            await saving

    def _spent(self, reason: str, message: str) -> ApiError:
        if self.stop_reason is None:
            self.stop_reason = reason
        return ApiError("context_length" if reason == "context_length" else "budget", message)

    def _fail(self, exc: BaseException) -> ApiError:
        self.failure = exc
        self.failed.set()
        return ApiError("cancelled", f"the job cannot go on: {exc}")

    async def _generate(self, request: ChatRequest) -> ChatResult:
        limits = self.limits
        if self.failure is not None:
            raise ApiError("cancelled", f"the job cannot go on: {self.failure}")
        if self.calls >= limits.max_turns:
            raise self._spent(
                "max_turns", f"the job's {limits.max_turns} model calls (agent.max_turns) are spent"
            )
        time_left = limits.time_left()
        if time_left is not None and time_left <= 0:
            raise self._spent("time_budget", "the job's time budget (agent.max_seconds) is spent")
        try:
            return await asyncio.wait_for(self._call(request), timeout=time_left)
        except TimeoutError:
            raise self._spent(
                "time_budget", "the job's time budget (agent.max_seconds) ran out during the call"
            ) from None
        except (JobCancelled, StalePolicy) as exc:
            raise self._fail(exc) from None
        except NoBackendError as exc:
            raise ApiError("server", f"no inference backend takes work: {exc}") from None
        except BackendError as exc:
            if exc.retryable:
                raise ApiError("server", f"the inference backend failed: {exc}") from None
            raise ApiError("invalid_request", f"the inference backend refused: {exc}") from None

    async def _call(self, request: ChatRequest) -> ChatResult:
        limits = self.limits
        conversation = self.conversation
        if self._context is None:
            self._context = await self.policy.max_model_len()
        context = self._context
        prompt = await conversation.plan(request.messages, request.tools)
        builder = conversation.builder
        extends = prompt.segment is None and builder is not None
        length = (conversation.sequence_length if extends else 0) + len(prompt.ids)
        total = (builder.total_response_length if builder is not None else 0) + (
            len(prompt.ids) if extends else 0
        )
        if length >= context:
            raise self._spent(
                "context_length",
                f"the conversation is {length} tokens and the model's context is {context}",
            )
        budget_left = limits.max_total_tokens - total
        if budget_left <= 0:
            raise self._spent(
                "token_budget",
                f"the job's {limits.max_total_tokens} tokens (agent.max_total_tokens) are spent",
            )
        since = 0.0 if self._replied_at is None else time.perf_counter() - self._replied_at
        conversation.commit(prompt, request.messages, request.tools, tool_seconds=since)
        builder = conversation.builder
        assert builder is not None
        asked = request.max_tokens or limits.max_tokens
        max_tokens = min(asked, limits.max_tokens, budget_left, context - length)
        started = time.perf_counter()
        completion = await self.policy.complete(
            builder.sequence,
            max_tokens=max_tokens,
            temperature=limits.temperature if request.temperature is None else request.temperature,
            top_p=limits.top_p if request.top_p is None else request.top_p,
            seed=limits.seed if request.seed is None else request.seed,
            stop=limits.stop if request.stop is None else request.stop,
        )
        text = await self._visible(completion)
        parsed = (
            Parsed(content=text)
            if request.tool_choice == "none" or not request.tools
            else self.parser.parse(text)
        )
        calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.calls]
        llm_seconds = time.perf_counter() - started
        conversation.record(completion, _reply(parsed), llm_seconds, tool_calls=calls)
        builder.malformed_tool_calls += parsed.errors
        self.calls += 1
        self._replied_at = time.perf_counter()
        self._saving = self.on_turn(builder)  # lands while the harness works on the answer
        return self._result(request, completion, parsed)

    async def _visible(self, completion: Completion) -> str:
        """The generated text as an API returns it: without the stop string or the stop token
        (EOS) that ended it (both stay in the recorded ids and text)."""
        text = completion.text
        if completion.finish_reason != "stop" or not completion.output_ids:
            return text
        if isinstance(completion.stop_reason, str):
            tail = completion.stop_reason
        else:
            last = completion.output_ids[-1]
            if last not in self._token_text:
                self._token_text[last] = await self.policy.detokenize([last])
            tail = self._token_text[last]
        return text[: -len(tail)] if tail and text.endswith(tail) else text

    def _result(self, request: ChatRequest, completion: Completion, parsed: Parsed) -> ChatResult:
        finish = "length" if completion.finish_reason == "length" else "stop"
        if parsed.calls and finish == "stop":
            finish = "tool_calls"
        logprobs = None
        if request.logprobs:
            logprobs = [
                TokenLogprob(token=f"token_id:{i}", logprob=lp)
                for i, lp in zip(completion.output_ids, completion.logprobs, strict=True)
            ]
        stop_sequence = completion.stop_reason if isinstance(completion.stop_reason, str) else None
        return ChatResult(
            id=uuid.uuid4().hex,
            model=request.model or self.model,
            content=parsed.content,
            tool_calls=parsed.calls,
            reasoning=parsed.reasoning,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=completion.prompt_tokens or 0,
            completion_tokens=len(completion.output_ids),
            logprobs=logprobs,
            created=int(time.time()),
            stop_sequence=stop_sequence,
        )


def _reply(parsed: Parsed) -> dict[str, Any]:
    """The answer as the assistant message a harness sends back to continue."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    return message
