"""The agent loop: call the policy, let the handler react, append its reply as ids, repeat."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from core.schemas import Compaction, ModelTurn
from routing.protocol import Completion, KnowsRefusedIds, PolicyClient
from routing.vllm import OutOfVocabularyError
from sandbox.base import SandboxSecurityError
from workers.compaction import COMPACTION, Compactor
from workers.conversation import Conversation, Templater
from workers.handlers.base import Handler
from workers.resume import Restored
from workers.toolcalls import ParsedCalls, bounded_arguments, format_result, parse_tool_calls
from workers.trajectory import TrajectoryBuilder

T = TypeVar("T")


class ToolRunner(Protocol):
    """The job's tool server as the loop uses it."""

    async def call(self, tool: str, **args: Any) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Limits:
    """Bounds of one episode; every field is resolved (no None) before the loop starts."""

    max_turns: int
    max_total_tokens: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    tool_timeout: float = 120.0
    deadline: float | None = None
    """`time.monotonic()` by which the episode stops (the job's time budget), or None."""

    def time_left(self) -> float | None:
        """Seconds until the deadline (0 once past it), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def tool_bound(self) -> float:
        """Most seconds a tool call may run now: `tool_timeout`, and no later than the
        deadline."""
        left = self.time_left()
        return self.tool_timeout if left is None else min(self.tool_timeout, left)


@dataclass
class Episode:
    builder: TrajectoryBuilder
    stop_reason: str
    truncated: bool


class _Stop(Exception):
    """Ends the episode: `reason` is its `stop_reason`."""

    def __init__(self, reason: str, truncated: bool) -> None:
        self.reason = reason
        self.truncated = truncated


async def run_episode(
    handler: Handler,
    task: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    policy: PolicyClient,
    templater: Templater,
    limits: Limits,
    on_turn: Callable[[TrajectoryBuilder], Awaitable[object] | None] = lambda _b: None,
    runner: ToolRunner | None = None,
    restored: Restored | None = None,
    compaction: Compaction | None = None,
) -> Episode:
    """Run the multi-turn loop until an answer, `max_turns`, a budget or the context ends it.

    `stop_reason` says which: `answer` (or the handler's own reason), `finish` (the model
    called the finish tool), `max_turns`, `token_budget`, `time_budget` (the limits'
    deadline passed: checked before every call, and a call still running then is cut off),
    `context_length` or `invalid_token` (the model generated an id outside the backend's
    vocabulary, so no later prompt can carry it: known before sending, or told by the
    backend's refusal of the next prompt; the trajectory keeps the id as returned). A call
    cut by its per-call `max_tokens` is handed on like any other turn.
    With `tools` declared, the turn's `<tool_call>` blocks are run on `runner` and their
    results appended as tool messages; a malformed call becomes an error message the model
    reads, and is counted. A turn without calls goes to the handler's `step`.
    `on_turn` sees the builder after every turn, so a partial trajectory can be saved (what
    it returns is awaited when awaitable: a save made on a thread). With `restored` (the
    state at an earlier worker's last saved turn, `workers.resume`), the loop goes on from
    there instead of the first call. With `compaction`, a sequence past its threshold is
    first summarised by the policy and the episode goes on in a new segment
    (`workers.compaction`); the summary calls do not count against `max_turns`.
    """
    declared = {t.get("function", t).get("name") for t in tools or []}
    context = await policy.max_model_len()
    # The task's first messages begin every compacted segment (also after a resume).
    compactor = None if compaction is None else Compactor(compaction, list(messages))
    pending: ModelTurn | None = None
    if restored is None:
        conversation = Conversation(templater)
        messages = list(messages)
        conversation.commit(await conversation.plan(messages, tools), messages, tools)
        first = 0
    else:
        conversation = restored.conversation(templater, tools)
        messages = list(restored.messages)
        first, pending = restored.first_turn, restored.pending
    builder = conversation.builder
    assert builder is not None
    try:
        _fits(builder, context, limits)
        for turn in range(first, limits.max_turns):
            turn_started = time.perf_counter()
            saving: Awaitable[object] | None = None
            if pending is None:
                max_tokens = _next_call(builder, context, limits, policy, turn)
                completion = await _call(policy, builder, limits, max_tokens)
                parsed = parse_tool_calls(completion.text) if tools else ParsedCalls()
                reply = {"role": "assistant", "content": completion.text}
                model_turn = conversation.record(
                    completion,
                    reply,
                    llm_seconds=time.perf_counter() - turn_started,
                    tool_calls=[c.as_dict() for c in parsed.calls],
                )
                builder.malformed_tool_calls += len(parsed.errors)
                saving = on_turn(builder)  # a save on a thread goes on while the tools run
            else:
                # A saved call whose reply was not (workers.resume): read again, not made again.
                model_turn, pending, max_tokens = pending, None, limits.max_tokens
                parsed = parse_tool_calls(model_turn.text) if tools else ParsedCalls()
                assert restored is not None  # a pending turn is a restored one
                reply = restored.reply
            step_started = time.perf_counter()
            try:
                _cut_by_bounds(model_turn, builder, context, limits, max_tokens)
                replies = await _within_budget(
                    _react(handler, task, model_turn.text, turn, parsed, declared, runner,
                           limits.tool_bound()),
                    limits,
                )  # fmt: skip
            finally:
                await _saved(saving)  # saved before anything else is (or the episode ends)
            if turn == limits.max_turns - 1:
                break
            messages = [*messages, reply, *replies]
            observation = await conversation.plan(messages, tools)
            if compactor is not None:
                compactor.note([reply, *replies])
            if compactor is not None and compactor.due(builder, len(observation.ids)):
                messages = await _compact(
                    compactor, conversation, builder, messages, tools, policy, limits, context,
                    on_turn, time.perf_counter() - step_started,
                )  # fmt: skip
            else:
                _fits(builder, context, limits, more=len(observation.ids))
                conversation.commit(
                    observation, messages, tools, time.perf_counter() - step_started
                )
            model_turn.turn_seconds = time.perf_counter() - turn_started
            await _saved(on_turn(builder))
    except _Stop as stop:
        return Episode(builder, stop.reason, stop.truncated)
    return Episode(builder, "max_turns", truncated=False)


async def _compact(
    compactor: Compactor,
    conversation: Conversation,
    builder: TrajectoryBuilder,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    policy: PolicyClient,
    limits: Limits,
    context: int,
    on_turn: Callable[[TrajectoryBuilder], Awaitable[object] | None],
    tool_seconds: float,
) -> list[dict[str, Any]]:
    """Instead of the last turn's replies alone, append them with the summary instruction and
    ask the policy for a summary (a model turn like any other, trained on); then begin a
    segment from the task's first messages, the summary and the most recent turns. Returns
    the messages the episode goes on from."""
    plan = compactor.plan
    ask = [*messages, {"role": "user", "content": plan.instruction}]
    request = await conversation.plan(ask, tools)
    _fits(builder, context, limits, more=len(request.ids) + 1)
    conversation.commit(request, ask, tools, tool_seconds)
    max_tokens = min(plan.max_summary_tokens, _next_call(builder, context, limits, policy, 1))
    started = time.perf_counter()
    completion = await _call(policy, builder, limits, max_tokens)
    reply = {"role": "assistant", "content": completion.text}
    conversation.record(completion, reply, llm_seconds=time.perf_counter() - started)
    await _saved(on_turn(builder))
    for fresh in compactor.candidates(completion.text):
        prompt = await conversation.plan(fresh, tools, segment=COMPACTION)
        if len(prompt.ids) < plan.threshold:
            break
    if len(prompt.ids) >= context:
        raise _Stop("context_length", truncated=True)
    conversation.commit(prompt, fresh, tools)
    compactor.compacted()
    return fresh


def _fits(builder: TrajectoryBuilder, context: int, limits: Limits, more: int = 0) -> None:
    """Stop when `more` ids after the sequence would spend the token budget or fill the
    context (the first prompt alone: when it fills the context)."""
    if more and builder.total_response_length + more >= limits.max_total_tokens:
        raise _Stop("token_budget", truncated=True)
    if builder.sequence_length + more >= context:
        raise _Stop("context_length", truncated=True)


def _next_call(
    builder: TrajectoryBuilder, context: int, limits: Limits, policy: PolicyClient, turn: int
) -> int:
    """The next call's `max_tokens`, or a stop: no budget, room or time is left, or the
    sequence holds an id the backend refuses."""
    budget_left = limits.max_total_tokens - builder.total_response_length
    room = context - builder.sequence_length
    if budget_left <= 0:
        raise _Stop("token_budget", truncated=True)
    if room <= 0:
        raise _Stop("context_length", truncated=True)
    if turn > 0 and _known_refused(policy, builder):
        raise _Stop("invalid_token", truncated=False)
    time_left = limits.time_left()
    if time_left is not None and time_left <= 0:
        raise _Stop("time_budget", truncated=True)
    return min(limits.max_tokens, budget_left, room)


async def _call(
    policy: PolicyClient, builder: TrajectoryBuilder, limits: Limits, max_tokens: int
) -> Completion:
    """The model call after the sequence, cut off at the deadline."""
    try:
        return await asyncio.wait_for(
            policy.complete(
                builder.sequence,
                max_tokens=max_tokens,
                temperature=limits.temperature,
                top_p=limits.top_p,
                seed=limits.seed,
                stop=limits.stop,
            ),
            timeout=limits.time_left(),
        )
    except TimeoutError:
        if limits.time_left() == 0:
            raise _Stop("time_budget", truncated=True) from None
        raise
    except OutOfVocabularyError as exc:
        if _generated_refused(builder, exc):
            raise _Stop("invalid_token", truncated=False) from None
        raise


async def _within_budget(work: Awaitable[T], limits: Limits) -> T:
    """The environment's step, cut off at the deadline: tool time counts against the job's
    time budget as model time does."""
    try:
        return await asyncio.wait_for(work, timeout=limits.time_left())
    except TimeoutError:
        if limits.time_left() == 0:
            raise _Stop("time_budget", truncated=True) from None
        raise


def _cut_by_bounds(
    completion: ModelTurn,
    builder: TrajectoryBuilder,
    context: int,
    limits: Limits,
    max_tokens: int,
) -> None:
    """A call cut by its own `max_tokens` is one truncated turn and the episode goes on; cut
    by the job's budget or the context, nothing more fits."""
    if completion.finish_reason != "length" or max_tokens >= limits.max_tokens:
        return
    if max_tokens == context - (builder.sequence_length - len(completion.output_ids)):
        raise _Stop("context_length", truncated=True)
    raise _Stop("token_budget", truncated=True)


async def _react(
    handler: Handler,
    task: dict[str, Any],
    text: str,
    turn: int,
    parsed: ParsedCalls,
    declared: set[str | None],
    runner: ToolRunner | None,
    tool_timeout: float,
) -> list[dict[str, Any]]:
    """The environment's reply to a model turn: its tool calls run, or the handler's step
    (a stop when the model called `finish` or the handler is done)."""
    if parsed.calls or parsed.errors:
        replies, finished = await _run_calls(parsed, declared, runner, tool_timeout)
        if finished:
            raise _Stop("finish", truncated=False)
        return replies
    step = handler.step(task, text, turn)
    if step.done:
        raise _Stop(step.stop_reason or "answer", truncated=False)
    return step.messages


def _generated_ids(builder: TrajectoryBuilder) -> list[int]:
    return [i for i, mask in zip(builder.response_ids, builder.loss_mask, strict=True) if mask]


def _known_refused(policy: PolicyClient, builder: TrajectoryBuilder) -> bool:
    """Whether the policy knows its backend refuses an id the model generated."""
    if not isinstance(policy, KnowsRefusedIds):
        return False
    return policy.first_refused(_generated_ids(builder)) is not None


def _generated_refused(builder: TrajectoryBuilder, exc: OutOfVocabularyError) -> bool:
    """Whether the backend refused the prompt for an id the model generated (an id the
    server rendered itself, or none named, is another fault)."""
    bound = exc.refused_from
    return bound is not None and any(i >= bound for i in _generated_ids(builder))


async def _run_calls(
    parsed: ParsedCalls, declared: set[str | None], runner: ToolRunner | None, timeout: float
) -> tuple[list[dict[str, Any]], bool]:
    """Run the turn's calls in order; returns the tool messages and whether `finish` was called
    (calls after `finish` are not run)."""
    replies = [{"role": "tool", "content": f"Error: {error}"} for error in parsed.errors]
    for call in parsed.calls:
        if call.name == "finish":
            return replies, True
        if call.name not in declared or runner is None:
            known = ", ".join(sorted(n for n in declared if n))
            content = f"Error: there is no tool {call.name!r}; the tools are: {known}"
        else:
            arguments = bounded_arguments(call.name, call.arguments, timeout)
            try:
                content = format_result(call.name, await runner.call(call.name, **arguments))
            except SandboxSecurityError:
                raise  # the stage fails as a security error; the model never sees it
            except Exception as exc:  # the model's mistake (bad arguments) or the tool's
                content = f"Error: {getattr(exc, 'message', None) or exc}"
        replies.append({"role": "tool", "content": content})
    return replies, False


async def _saved(result: Awaitable[object] | None) -> None:
    if inspect.isawaitable(result):
        await result
