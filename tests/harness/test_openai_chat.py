"""Chat Completions through the official `openai` SDK against a served endpoint."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.harness.served import KEY, FakeEndpoint
from workers.harness.wire import ApiError, TokenLogprob, ToolCallOut

USER = [{"role": "user", "content": "Say hello."}]
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def test_completion_returns_the_generated_text_and_usage(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hello there.", prompt_tokens=20, completion_tokens=4)
    completion = openai_client.chat.completions.create(model="anything", messages=USER)
    assert completion.id == "chatcmpl-abc123"
    assert completion.choices[0].message.content == "Hello there."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (20, 4)
    assert completion.usage.total_tokens == 24


def test_request_reaches_the_endpoint_in_canonical_form(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    openai_client.chat.completions.create(
        model="the-policy",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        temperature=0.5,
        top_p=0.9,
        seed=7,
        max_completion_tokens=64,
        stop="END",
    )
    request = endpoint.last
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
    ]
    assert (request.temperature, request.top_p, request.seed) == (0.5, 0.9, 7)
    assert request.max_tokens == 64
    assert request.stop == ["END"]
    assert request.model == "the-policy"
    assert not request.stream


def test_tool_calls_come_back_with_null_content_and_tool_calls_finish(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    call = ToolCallOut(id="call_1", name="bash", arguments='{"command": "ls"}')
    endpoint.will_answer(content="", tool_calls=[call], finish_reason="tool_calls")
    completion = openai_client.chat.completions.create(
        model="m", messages=USER, tools=[BASH], tool_choice="auto"
    )
    message = completion.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    [sent] = message.tool_calls
    assert sent.type == "function"
    assert (sent.id, sent.function.name, sent.function.arguments) == (
        "call_1",
        "bash",
        '{"command": "ls"}',
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    assert endpoint.last.tools == [BASH]
    assert endpoint.last.tool_choice == "auto"


def test_tool_call_round_trip_gives_canonical_assistant_and_tool_messages(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    call = ToolCallOut(id="call_1", name="bash", arguments='{"command": "ls"}')
    endpoint.will_answer(content="", tool_calls=[call], finish_reason="tool_calls")
    first = openai_client.chat.completions.create(model="m", messages=USER, tools=[BASH])
    # As harnesses do: the SDK's own message object goes back into the conversation.
    history: list[Any] = [*USER, first.choices[0].message]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "a.txt"})
    openai_client.chat.completions.create(model="m", messages=history, tools=[BASH])
    assert endpoint.last.messages == [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]


def test_logprobs_are_returned_when_asked(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(
        content="Hi",
        logprobs=[TokenLogprob("H", -0.5), TokenLogprob("i", -0.25, bytes=[105])],
    )
    completion = openai_client.chat.completions.create(model="m", messages=USER, logprobs=True)
    assert endpoint.last.logprobs
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(t.token, t.logprob, t.bytes) for t in logprobs.content] == [
        ("H", -0.5, [72]),
        ("i", -0.25, [105]),
    ]


def test_stream_yields_role_content_finish_and_usage_chunks(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="Hello there.", prompt_tokens=20, completion_tokens=4)
    chunks = list(
        openai_client.chat.completions.create(
            model="m", messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    assert endpoint.last.stream and endpoint.last.stream_usage
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 24


def test_stream_carries_each_tool_call_with_its_index(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    calls = [
        ToolCallOut(id="call_1", name="bash", arguments='{"command": "ls"}'),
        ToolCallOut(id="call_2", name="bash", arguments='{"command": "pwd"}'),
    ]
    endpoint.will_answer(content="Looking.", tool_calls=calls, finish_reason="tool_calls")
    with openai_client.chat.completions.stream(model="m", messages=USER, tools=[BASH]) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Looking."
    assert message.tool_calls is not None
    assert [(c.id, c.function.arguments) for c in message.tool_calls] == [
        ("call_1", '{"command": "ls"}'),
        ("call_2", '{"command": "pwd"}'),
    ]
    assert final.choices[0].finish_reason == "tool_calls"


def _refusal(client: openai.OpenAI, **params: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": "m", "messages": USER, **params})
    return caught.value


def test_more_than_one_choice_is_refused_naming_n(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, n=2).param == "n"


def test_an_image_part_is_refused_naming_the_part(openai_client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}]
    err = _refusal(openai_client, messages=messages)
    assert err.param == "messages[0].content[1].type"
    assert "image_url" in err.message


def test_logit_bias_is_refused(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, logit_bias={"100": 5}).param == "logit_bias"


def test_penalties_other_than_zero_are_refused(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, presence_penalty=0.5).param == "presence_penalty"


def test_top_logprobs_above_zero_are_refused(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, logprobs=True, top_logprobs=3).param == "top_logprobs"


def test_json_response_format_is_refused(openai_client: openai.OpenAI) -> None:
    err = _refusal(openai_client, response_format={"type": "json_object"})
    assert err.param == "response_format.type"


def test_an_unknown_field_is_refused_naming_it(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, extra_body={"min_p": 0.1}).param == "min_p"


def test_a_field_of_the_wrong_type_is_refused_naming_it(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, extra_body={"temperature": "hot"}).param == "temperature"


def test_empty_messages_are_refused(openai_client: openai.OpenAI) -> None:
    assert _refusal(openai_client, messages=[]).param == "messages"


def test_a_spent_budget_is_a_rate_limit_error_the_sdk_does_not_retry(
    server: str, endpoint: FakeEndpoint, budget_spent: ApiError
) -> None:
    endpoint.will_fail(budget_spent)
    endpoint.will_answer()  # what a retry would get
    # A client with the SDK's default retries, which would retry a 429 unless told not to.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    with client, pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="m", messages=USER)
    assert caught.value.code == "insufficient_quota"
    assert "agent.max_turns" in caught.value.message
    assert len(endpoint.requests) == 1


def test_a_context_too_long_has_its_error_code(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_fail(ApiError("context_length", "the conversation is 9000 tokens"))
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="m", messages=USER)
    assert caught.value.code == "context_length_exceeded"


def test_an_error_of_a_streaming_request_is_a_normal_error_response(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint, budget_spent: ApiError
) -> None:
    endpoint.will_fail(budget_spent)
    with pytest.raises(openai.RateLimitError):
        openai_client.chat.completions.create(model="m", messages=USER, stream=True)


def test_a_tool_call_id_keeps_the_form_the_harness_saw(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(
        content="", tool_calls=[ToolCallOut("7f3a", "bash", json.dumps({"command": "ls"}))]
    )
    completion = openai_client.chat.completions.create(model="m", messages=USER, tools=[BASH])
    message = completion.choices[0].message
    assert message.tool_calls is not None
    assert message.tool_calls[0].id == "call_7f3a"


def test_reasoning_is_returned_beside_the_content(
    openai_client: openai.OpenAI, endpoint: FakeEndpoint
) -> None:
    endpoint.will_answer(content="4.", reasoning="2 and 2 make 4.")
    completion = openai_client.chat.completions.create(model="m", messages=USER)
    message = completion.choices[0].message
    assert message.content == "4."
    assert message.model_extra == {"reasoning_content": "2 and 2 make 4."}
