"""The job's side of the harness endpoint, called directly: a scripted policy over a character
chat template, no server. What a call records, how its answer is parsed, and how the job's
budgets and its end reach the harness."""

from __future__ import annotations

from typing import Any

import pytest

from routing.protocol import Completion
from tests.support.toytemplate import END, ToyTemplater, answer, chars
from workers.agent import Limits
from workers.harness.session import HarnessSession
from workers.harness.toolparsers import get_parser
from workers.harness.wire import ApiError, ChatRequest
from workers.routed_policy import JobCancelled

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'


class ScriptedModel(ToyTemplater):
    def __init__(self, script: list[str | BaseException], context: int = 4096) -> None:
        super().__init__()
        self.script = list(script)
        self.context = context
        self.requests: list[dict[str, Any]] = []

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        self.requests.append({"prompt_ids": list(prompt_ids), **params})
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        done = answer(step)
        if len(done.output_ids) > params["max_tokens"]:
            done.output_ids = done.output_ids[: params["max_tokens"]]
            done.logprobs = done.logprobs[: params["max_tokens"]]
            done.finish_reason = "length"
        return done

    async def max_model_len(self) -> int:
        return self.context


def _session(model: ScriptedModel, **limits: Any) -> HarnessSession:
    bounds = {"max_turns": 8, "max_total_tokens": 10_000, "max_tokens": 500} | limits
    return HarnessSession("job-1", model, Limits(**bounds), get_parser("hermes"))


def _ask(messages: list[dict[str, Any]], **fields: Any) -> ChatRequest:
    return ChatRequest(messages=messages, **fields)


USER = [{"role": "user", "content": "list the files"}]


async def test_a_tool_call_comes_back_parsed_and_its_ids_as_generated() -> None:
    model = ScriptedModel([CALL])
    session = _session(model)
    result = await session.generate(_ask(USER, tools=TOOLS))
    assert result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("bash", '{"command": "ls"}')]
    assert result.content == ""
    assert session.builder is not None
    assert session.builder.response_ids == [*chars(CALL), END]
    assert session.builder.turns[0].tool_calls == [{"name": "bash", "arguments": {"command": "ls"}}]


async def test_the_tool_result_sent_back_continues_the_same_sequence() -> None:
    model = ScriptedModel([CALL, "two files"])
    session = _session(model)
    first = await session.generate(_ask(USER, tools=TOOLS))
    call = first.tool_calls[0]
    back = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]}  # fmt: skip
    tool = {"role": "tool", "tool_call_id": call.id, "content": "a b"}
    second = await session.generate(_ask([*USER, back, tool], tools=TOOLS))
    assert second.content == "two files" and second.finish_reason == "stop"
    assert session.builder is not None and session.builder.segment_count == 1
    assert (
        model.requests[1]["prompt_ids"][: len(model.requests[0]["prompt_ids"])]
        == (model.requests[0]["prompt_ids"])
    )


async def test_a_malformed_call_is_plain_content_and_counted() -> None:
    broken = '<tool_call>{"name": "bash", "arguments": </tool_call>'
    session = _session(ScriptedModel([broken]))
    result = await session.generate(_ask(USER, tools=TOOLS))
    assert result.tool_calls == [] and result.content == broken
    assert result.finish_reason == "stop"
    assert session.builder is not None and session.builder.malformed_tool_calls == 1


async def test_past_max_turns_a_call_is_refused_and_the_job_says_why() -> None:
    session = _session(ScriptedModel(["a", "b"]), max_turns=1)
    first = await session.generate(_ask(USER))
    again = [*USER, {"role": "assistant", "content": first.content}, *USER]
    with pytest.raises(ApiError) as refused:
        await session.generate(_ask(again))
    assert refused.value.status == 429 and "agent.max_turns" in refused.value.message
    assert session.stop_reason == "max_turns" and session.refused == 1


async def test_a_call_is_cut_to_the_tokens_left_of_the_job() -> None:
    model = ScriptedModel(["a long answer"])
    session = _session(model, max_total_tokens=5)
    result = await session.generate(_ask(USER, max_tokens=100))
    assert model.requests[0]["max_tokens"] == 5
    assert result.finish_reason == "length" and result.completion_tokens == 5


async def test_a_conversation_past_the_context_is_refused_as_context_length() -> None:
    session = _session(ScriptedModel(["x"], context=10))
    with pytest.raises(ApiError) as refused:
        await session.generate(_ask(USER))
    assert refused.value.kind == "context_length" and refused.value.status == 400
    assert session.stop_reason == "context_length"


async def test_a_job_ended_during_a_call_fails_the_call_and_tells_the_stage() -> None:
    session = _session(ScriptedModel([JobCancelled("job-1 is no longer live")]))
    with pytest.raises(ApiError) as refused:
        await session.generate(_ask(USER))
    assert refused.value.kind == "cancelled"
    assert isinstance(session.failure, JobCancelled) and session.failed.is_set()


async def test_the_harness_sampling_is_used_and_the_job_fills_the_rest() -> None:
    model = ScriptedModel(["x"])
    session = _session(model, temperature=1.0, seed=11, stop=["</s>"])
    await session.generate(_ask(USER, temperature=0.2, logprobs=True))
    sent = model.requests[0]
    assert (sent["temperature"], sent["seed"], sent["stop"]) == (0.2, 11, ["</s>"])
