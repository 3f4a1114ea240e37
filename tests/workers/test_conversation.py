"""The turn bookkeeping shared by the agent loop and the harness endpoint: when a call extends the
sequence, when it starts a new segment and why, and that the record flattens to the same
segments the job store derives from the turns."""

from __future__ import annotations

from typing import Any

from core.flatten import derivable, fill_flat, sequences
from core.schemas import Trajectory
from tests.support.toytemplate import END, HEADERS, ToyTemplater, answer, chars
from workers.conversation import Conversation

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hi"}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]


async def _first_call(conv: Conversation, text: str = "ok") -> dict[str, Any]:
    messages = [SYSTEM, USER]
    conv.commit(await conv.plan(messages, None), messages, None)
    reply = {"role": "assistant", "content": text}
    conv.record(answer(text), reply, llm_seconds=0.1)
    return reply


async def test_a_call_that_continues_the_last_one_appends_only_its_new_messages() -> None:
    templater = ToyTemplater()
    conv = Conversation(templater)
    reply = await _first_call(conv)
    tool = {"role": "tool", "content": "x"}
    messages = [SYSTEM, USER, dict(reply), tool]  # sent back as a copy, as a harness does
    prompt = await conv.plan(messages, None)
    assert prompt.segment is None
    assert prompt.ids == [HEADERS["tool"], *chars("x"), END, HEADERS["assistant"]]
    assert templater.full_renders == 1  # only the first prompt was rendered whole
    conv.commit(prompt, messages, None, tool_seconds=0.5)
    assert conv.builder is not None
    full = await ToyTemplater().prompt_ids(messages)
    assert conv.builder.sequence == full


async def test_an_edited_history_starts_a_new_segment_that_says_so() -> None:
    conv = Conversation(ToyTemplater())
    reply = await _first_call(conv)
    edited = [
        {"role": "system", "content": "be verbose"},
        USER,
        reply,
        {"role": "user", "content": "?"},
    ]
    prompt = await conv.plan(edited, None)
    assert prompt.segment == "history_changed"
    assert prompt.ids == await ToyTemplater().prompt_ids(edited)


async def test_a_reply_sent_back_altered_starts_a_new_segment() -> None:
    conv = Conversation(ToyTemplater())
    await _first_call(conv, "ok")
    altered = [
        SYSTEM,
        USER,
        {"role": "assistant", "content": "OK!"},
        {"role": "user", "content": "?"},
    ]
    assert (await conv.plan(altered, None)).segment == "reply_changed"


async def test_a_request_sent_again_is_a_retry() -> None:
    conv = Conversation(ToyTemplater())
    await _first_call(conv)
    assert (await conv.plan([SYSTEM, USER], None)).segment == "retried"


async def test_other_tools_start_a_new_segment() -> None:
    conv = Conversation(ToyTemplater())
    reply = await _first_call(conv)
    messages = [SYSTEM, USER, reply, {"role": "user", "content": "go"}]
    assert (await conv.plan(messages, TOOLS)).segment == "tools_changed"


async def test_tool_call_arguments_sent_back_reformatted_still_continue() -> None:
    conv = Conversation(ToyTemplater())
    messages = [SYSTEM, USER]
    conv.commit(await conv.plan(messages, TOOLS), messages, TOOLS)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "bash", "arguments": '{"command":"ls","timeout":5}'}}  # fmt: skip
    conv.record(answer("run"), {"role": "assistant", "content": "run", "tool_calls": [call]}, 0.1)
    again = {"name": "bash", "arguments": '{"timeout": 5, "command": "ls"}'}
    back = {"role": "assistant", "content": "run\n",
            "tool_calls": [{"id": "other", "type": "function", "function": again}]}  # fmt: skip
    later = [*messages, back, {"role": "tool", "content": "a b", "tool_call_id": "call_1"}]
    assert (await conv.plan(later, TOOLS)).segment is None


async def test_two_segments_flatten_as_the_job_store_derives_them() -> None:
    conv = Conversation(ToyTemplater())
    reply = await _first_call(conv)
    messages = [SYSTEM, USER, reply, {"role": "tool", "content": "x"}]
    conv.commit(await conv.plan(messages, None), messages, None)
    second = {"role": "assistant", "content": "done"}
    conv.record(answer("done"), second, 0.1)
    summary = [SYSTEM, {"role": "user", "content": "summary"}]
    conv.commit(await conv.plan(summary, None), summary, None)
    conv.record(answer("again", version=4), {"role": "assistant", "content": "again"}, 0.1)
    assert conv.builder is not None
    built = conv.builder.fill(Trajectory(job_id="j", group_id="g", instance_id="i",
                                         data_source="shell", status="run"))  # fmt: skip
    assert derivable(built)
    derived = fill_flat(built.model_copy(update={"segments": []}))
    assert derived.segments == built.segments
    first, second_segment = sequences(built)
    assert first.reason == "start" and first.policy_versions == [3, 3]
    assert second_segment.reason == "history_changed"
    assert second_segment.first_turn == 3
    assert second_segment.prompt_ids == await ToyTemplater().prompt_ids(summary)
    assert second_segment.response_ids == [*chars("again"), END]
    assert second_segment.loss_mask == [1] * 6 and second_segment.policy_versions == [4]
    assert first.loss_mask.count(0) == len(chars("x")) + 3  # tool header, text, end, gen
