"""Anthropic Messages through the official `anthropic` SDK against a served endpoint."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.harness.served import FakeEndpoint
from workers.harness.wire import ApiError, ToolCallOut

USER: list[Any] = [{"role": "user", "content": "Say hello."}]
BASH: Any = {
    "name": "bash",
    "description": "Run a command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}
LS = ToolCallOut(id="toolu_1", name="bash", arguments='{"command": "ls"}')


def test_a_message_returns_the_text_and_usage(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hello there.", prompt_tokens=20, completion_tokens=4)
    message = anthropic_client.messages.create(model="m", max_tokens=64, messages=USER)
    assert message.id == "msg_abc123"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [
        ("text", "Hello there.")
    ]
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (20, 4)
    assert endpoint.last.max_tokens == 64


def test_the_system_prompt_becomes_the_first_message(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    anthropic_client.messages.create(
        model="m",
        max_tokens=64,
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be kind."},
        ],
        messages=USER,
        stop_sequences=["END"],
        # This SDK has no sampling arguments any more; older ones and raw clients send them.
        extra_body={"temperature": 0.2},
    )
    request = endpoint.last
    assert request.messages == [{"role": "system", "content": "Be brief.\nBe kind."}, *USER]
    assert (request.temperature, request.stop) == (0.2, ["END"])


def test_a_tool_call_comes_back_as_a_tool_use_block(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="", tool_calls=[LS], finish_reason="tool_calls")
    message = anthropic_client.messages.create(
        model="m", max_tokens=64, messages=USER, tools=[BASH], tool_choice={"type": "any"}
    )
    [block] = message.content
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == ("toolu_1", "bash", {"command": "ls"})
    assert message.stop_reason == "tool_use"
    assert endpoint.last.tool_choice == "required"
    assert endpoint.last.tools == [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a command.",
                "parameters": BASH["input_schema"],
            },
        }
    ]


def test_a_tool_result_round_trip_gives_tool_messages_then_the_user_text(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    pwd = ToolCallOut(id="toolu_2", name="bash", arguments='{"command": "pwd"}')
    endpoint.will_answer(content="Looking.", tool_calls=[LS, pwd], finish_reason="tool_calls")
    first = anthropic_client.messages.create(model="m", max_tokens=64, messages=USER, tools=[BASH])
    results = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": [{"type": "text", "text": "/repo"}],
            "is_error": False,
        },
        {"type": "text", "text": "Go on."},
    ]
    history = [*USER, {"role": "assistant", "content": first.content}]
    history.append({"role": "user", "content": results})
    anthropic_client.messages.create(model="m", max_tokens=64, messages=history, tools=[BASH])
    assert endpoint.last.messages == [
        *USER,
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "pwd"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "/repo"},
        {"role": "user", "content": "Go on."},
    ]


def test_thinking_blocks_sent_back_are_dropped(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    thought = {"type": "thinking", "thinking": "Hmm.", "signature": "sig"}
    said = {"type": "text", "text": "Hello."}
    history = [*USER, {"role": "assistant", "content": [thought, said]}]
    history.append({"role": "user", "content": "Again."})
    anthropic_client.messages.create(model="m", max_tokens=64, messages=history)
    assert endpoint.last.messages[1] == {"role": "assistant", "content": "Hello."}


def test_the_stream_helper_builds_the_final_message(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Looking.", tool_calls=[LS], finish_reason="tool_calls")
    with anthropic_client.messages.stream(
        model="m", max_tokens=64, messages=USER, tools=[BASH]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert endpoint.last.stream
    assert text == "Looking."
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"command": "ls"}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 3


def test_a_raw_stream_is_anthropics_event_sequence(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hi.", tool_calls=[LS], finish_reason="tool_calls")
    stream = anthropic_client.messages.create(
        model="m", max_tokens=64, messages=USER, tools=[BASH], stream=True
    )
    kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]


def test_a_stop_sequence_that_ended_the_text_is_reported(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Done", stop_sequence="END")
    message = anthropic_client.messages.create(
        model="m", max_tokens=64, messages=USER, stop_sequences=["END"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


def test_a_generation_cut_by_the_token_limit_stops_for_max_tokens(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Once upon", finish_reason="length")
    message = anthropic_client.messages.create(model="m", max_tokens=2, messages=USER)
    assert message.stop_reason == "max_tokens"


def _refusal(client: anthropic.Anthropic, **params: Any) -> anthropic.BadRequestError:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**{"model": "m", "max_tokens": 64, "messages": USER, **params})
    return caught.value


def test_top_k_is_refused_naming_it(anthropic_client: anthropic.Anthropic) -> None:
    err = _refusal(anthropic_client, extra_body={"top_k": 40})
    assert err.body["error"]["type"] == "invalid_request_error"
    assert "`top_k`" in err.message


def test_an_image_block_is_refused_naming_it(anthropic_client: anthropic.Anthropic) -> None:
    source = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    messages = [{"role": "user", "content": [{"type": "image", "source": source}]}]
    assert "`messages[0].content[0].type`" in _refusal(anthropic_client, messages=messages).message


def test_a_server_tool_is_refused(anthropic_client: anthropic.Anthropic) -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search"}]
    assert "`tools[0].type`" in _refusal(anthropic_client, tools=tools).message


def test_a_missing_max_tokens_is_refused(anthropic_client: anthropic.Anthropic) -> None:
    err = _refusal(anthropic_client, extra_body={"max_tokens": None})
    assert "`max_tokens`" in err.message


def test_a_structured_output_format_is_refused(anthropic_client: anthropic.Anthropic) -> None:
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    err = _refusal(anthropic_client, output_config={"effort": "high", "format": schema})
    assert "`output_config.format`" in err.message


def test_a_wrong_key_is_an_authentication_error(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="sk-wrong", max_retries=0)
    with client, pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.create(model="m", max_tokens=64, messages=USER)
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_spent_budget_is_a_rate_limit_error(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint, budget_spent: ApiError
) -> None:
    endpoint.will_fail(budget_spent)
    with pytest.raises(anthropic.RateLimitError) as caught:
        anthropic_client.messages.create(model="m", max_tokens=64, messages=USER)
    assert caught.value.body["error"]["type"] == "rate_limit_error"


def test_token_counting_is_not_found_in_anthropics_shape(
    anthropic_client: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.count_tokens(model="m", messages=USER)
    assert caught.value.body["type"] == "error"


def test_disabling_parallel_tool_use_reaches_the_endpoint(
    anthropic_client: anthropic.Anthropic, endpoint: FakeEndpoint
) -> None:
    choice: Any = {"type": "tool", "name": "bash", "disable_parallel_tool_use": True}
    anthropic_client.messages.create(
        model="m", max_tokens=64, messages=USER, tools=[BASH], tool_choice=choice
    )
    assert endpoint.last.tool_choice == {"type": "function", "function": {"name": "bash"}}
    assert endpoint.last.parallel_tool_calls is False
