"""The Responses API through the official `openai` SDK against a served endpoint."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.harness.served import FakeEndpoint
from workers.harness.wire import TokenLogprob, ToolCallOut

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}
CANONICAL_SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a command.",
        "parameters": SHELL["parameters"],
    },
}
LS = ToolCallOut(id="call_1", name="shell", arguments='{"command": "ls"}')


def test_a_response_carries_the_output_text_and_usage(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hello there.", prompt_tokens=20, completion_tokens=4)
    response = openai_client.responses.create(model="m", input="Say hello.")
    assert response.id == "resp_abc123"
    assert response.status == "completed"
    assert response.output_text == "Hello there."
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (20, 4)
    assert response.usage.total_tokens == 24


def test_instructions_and_input_items_become_canonical_messages(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    openai_client.responses.create(
        model="m",
        instructions="You are a coding agent.",
        input=[
            {"role": "developer", "content": "Work in /repo."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Fix it."}],
            },
        ],
        max_output_tokens=128,
        temperature=0.3,
        store=False,
    )
    request = endpoint.last
    assert request.messages == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "system", "content": "Work in /repo."},
        {"role": "user", "content": "Fix it."},
    ]
    assert (request.max_tokens, request.temperature) == (128, 0.3)


def test_a_tool_call_comes_back_as_a_function_call_item(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="", tool_calls=[LS], finish_reason="tool_calls")
    response = openai_client.responses.create(model="m", input="List.", tools=[SHELL])
    [item] = response.output
    assert item.type == "function_call"
    assert (item.call_id, item.name, item.arguments) == ("call_1", "shell", '{"command": "ls"}')
    assert item.id == "fc_call_1"
    assert endpoint.last.tools == [CANONICAL_SHELL]


def test_a_function_call_round_trip_gives_an_assistant_turn_and_a_tool_message(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Listing.", tool_calls=[LS], finish_reason="tool_calls")
    first = openai_client.responses.create(model="m", input="List.", tools=[SHELL])
    # As Codex does: every output item goes back, then the call's output.
    history: list[Any] = [{"role": "user", "content": "List."}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": "call_1", "output": "a.txt"})
    history.append({"type": "reasoning", "id": "rs_1", "summary": []})
    openai_client.responses.create(model="m", input=history, tools=[SHELL])
    assert endpoint.last.messages == [
        {"role": "user", "content": "List."},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "shell", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]


def test_the_stream_helper_parses_every_event_and_the_final_response(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Listing.", tool_calls=[LS], finish_reason="tool_calls")
    with openai_client.responses.stream(model="m", input="List.", tools=[SHELL]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "Listing."
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        ("message", None),
        ("function_call", '{"command": "ls"}'),
    ]


def test_stream_events_are_numbered_in_order(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    events = list(openai_client.responses.create(model="m", input="Hi.", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert endpoint.last.stream


def test_a_generation_cut_by_the_token_limit_is_incomplete(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Once upon", finish_reason="length")
    response = openai_client.responses.create(model="m", input="Tell a story.", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_a_cut_stream_ends_with_response_incomplete(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Once upon", finish_reason="length")
    events = list(openai_client.responses.create(model="m", input="Story.", stream=True))
    assert events[-1].type == "response.incomplete"


def test_output_text_logprobs_come_when_included(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hi", logprobs=[TokenLogprob("H", -0.5), TokenLogprob("i", -0.1)])
    response = openai_client.responses.create(
        model="m", input="Hi.", include=["message.output_text.logprobs"]
    )
    assert endpoint.last.logprobs
    part = response.output[0].content[0]
    assert part.type == "output_text"
    assert [(lp.token, lp.logprob) for lp in part.logprobs or []] == [("H", -0.5), ("i", -0.1)]


def _refusal(client: openai.OpenAI, **params: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": "m", "input": "Hi.", **params})
    return caught.value


def test_previous_response_id_is_refused(openai_client: openai.OpenAI) -> None:
    err = _refusal(openai_client, previous_response_id="resp_1")
    assert err.param == "previous_response_id"
    assert "whole conversation" in err.message


def test_a_tool_that_is_not_a_function_is_refused(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, tools=[{"type": "web_search"}]).param == "tools[0].type"


def test_an_image_input_is_refused_naming_the_part(openai_client: openai.OpenAI) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    err = _refusal(openai_client, input=[{"role": "user", "content": [image]}])
    assert err.param == "input[0].content[0].type"


def test_a_json_text_format_is_refused(openai_client: openai.OpenAI) -> None:
    err = _refusal(openai_client, text={"format": {"type": "json_object"}})
    assert err.param == "text.format.type"
