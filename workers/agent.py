"""The agent loop: call the policy, let the handler react, append its reply as ids, repeat."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from routing.protocol import KnowsRefusedIds, PolicyClient
from routing.vllm import OutOfVocabularyError
from sandbox.base import SandboxSecurityError
from workers.handlers.base import Handler
from workers.toolcalls import ParsedCalls, format_result, parse_tool_calls
from workers.trajectory import TrajectoryBuilder


class Templater(Protocol):
    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


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


@dataclass
class Episode:
    builder: TrajectoryBuilder
    stop_reason: str
    truncated: bool


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
) -> Episode:
    """Run the multi-turn loop until an answer, `max_turns`, a budget or the context ends it.

    `stop_reason` says which: `answer` (or the handler's own reason), `finish` (the model
    called the finish tool), `max_turns`, `token_budget`, `time_budget` (the limits'
    deadline passed: checked before every call, and a call still running then is cut off),
    `context_length` or
    `invalid_token` (the model generated an id outside the backend's vocabulary, so no later
    prompt can carry it: known before sending, or told by the backend's refusal of the next
    prompt; the trajectory keeps the id as returned). A call cut by its per-call
    `max_tokens` is handed on like any other turn.
    With `tools` declared, the turn's `<tool_call>` blocks are run on `runner` and their
    results appended as tool messages; a malformed call becomes an error message the model
    reads, and is counted. A turn without calls goes to the handler's `step`.
    `on_turn` sees the builder after every turn, so a partial trajectory can be saved (what
    it returns is awaited when awaitable: a save made on a thread).
    """
    declared = {t.get("function", t).get("name") for t in tools or []}
    prompt = await templater.prompt_ids(messages, tools)
    context = await policy.max_model_len()
    builder = TrajectoryBuilder(prompt)
    if len(prompt) >= context:
        return Episode(builder, "context_length", truncated=True)

    for turn in range(limits.max_turns):
        budget_left = limits.max_total_tokens - len(builder.response_ids)
        room = context - builder.sequence_length
        if budget_left <= 0:
            return Episode(builder, "token_budget", truncated=True)
        if room <= 0:
            return Episode(builder, "context_length", truncated=True)
        max_tokens = min(limits.max_tokens, budget_left, room)
        if turn > 0 and _known_refused(policy, builder):
            return Episode(builder, "invalid_token", truncated=False)
        time_left = limits.time_left()
        if time_left is not None and time_left <= 0:
            return Episode(builder, "time_budget", truncated=True)

        turn_started = started = time.perf_counter()
        try:
            completion = await asyncio.wait_for(
                policy.complete(
                    builder.sequence,
                    max_tokens=max_tokens,
                    temperature=limits.temperature,
                    top_p=limits.top_p,
                    seed=limits.seed,
                    stop=limits.stop,
                ),
                timeout=time_left,
            )
        except TimeoutError:
            if limits.time_left() == 0:
                return Episode(builder, "time_budget", truncated=True)
            raise
        except OutOfVocabularyError as exc:
            if _generated_refused(builder, exc):
                return Episode(builder, "invalid_token", truncated=False)
            raise
        llm_seconds = time.perf_counter() - started
        parsed = parse_tool_calls(completion.text) if tools else ParsedCalls()
        model_turn = builder.add_model_turn(
            completion.output_ids,
            completion.logprobs,
            completion.text,
            completion.finish_reason,
            llm_seconds=llm_seconds,
            tool_calls=[c.as_dict() for c in parsed.calls],
        )
        model_turn.backend_id = completion.backend_id
        model_turn.policy_version = completion.policy_version
        builder.malformed_tool_calls += len(parsed.errors)
        saving = on_turn(builder)  # a save on a thread goes on while the tools run

        if completion.finish_reason == "length":
            # A call cut by its own max_tokens is one truncated turn; the episode goes on.
            # Cut by the job's budget or the context, nothing more fits.
            if max_tokens == room and room < limits.max_tokens:
                await _saved(saving)
                return Episode(builder, "context_length", truncated=True)
            if max_tokens == budget_left and budget_left < limits.max_tokens:
                await _saved(saving)
                return Episode(builder, "token_budget", truncated=True)

        step_started = time.perf_counter()
        try:
            if parsed.calls or parsed.errors:
                replies, finished = await _run_calls(parsed, declared, runner, limits.tool_timeout)
                step = None
            else:
                finished = False
                step = handler.step(task, completion.text, turn)
                replies = step.messages
            step_seconds = time.perf_counter() - step_started
        finally:
            await _saved(saving)  # saved before anything else is (or the episode ends)
        if finished:
            return Episode(builder, "finish", truncated=False)
        if step is not None and step.done:
            return Episode(builder, step.stop_reason or "answer", truncated=False)
        if turn == limits.max_turns - 1:
            break
        observation = await templater.continuation_ids(completion.output_ids, replies, tools)
        if len(builder.response_ids) + len(observation) >= limits.max_total_tokens:
            return Episode(builder, "token_budget", truncated=True)
        if builder.sequence_length + len(observation) >= context:
            return Episode(builder, "context_length", truncated=True)
        builder.add_env_turn(
            observation,
            text="\n".join(str(m.get("content", "")) for m in replies),
            tool_seconds=step_seconds,
        )
        model_turn.turn_seconds = time.perf_counter() - turn_started
        await _saved(on_turn(builder))
    return Episode(builder, "max_turns", truncated=False)


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
            arguments = dict(call.arguments)
            if call.name in ("bash", "ipython"):
                arguments.setdefault("timeout", timeout)
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
