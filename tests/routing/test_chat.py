"""ChatTemplater: the first prompt by the model's template, then ids are only ever appended."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from routing.chat import ChatTemplater, TemplateError
from routing.protocol import Completion
from routing.vllm import VLLMClient

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


IM_END, NEWLINE = 151645, 198

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]

# Qwen3's behaviour that matters here: an assistant turn after the last user query shows its
# reasoning (an empty think block if it has none); earlier turns lose theirs on re-rendering.
QWEN3_LIKE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
  {%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'user' or m.role == 'system' %}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set content = m.content %}
    {%- set reasoning = '' %}
    {%- if '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
      {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
      {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') }}
      {{- '\\n</think>\\n\\n' + content.lstrip('\\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\\n' + content }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
  {%- elif m.role == 'tool' %}
    {{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# A template whose system prompt depends on the whole conversation: appending is impossible.
COUNTING = """
{{- '<|im_start|>system\\nThis conversation has ' + (messages|length)|string }}
{{- ' messages.<|im_end|>\\n' }}
{%- for m in messages %}
  {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


# Renders tool results differently when tools are declared: the declarations then shape
# later messages, so every continuation must be rendered with them.
TOOL_AWARE = """\
{%- for m in messages %}<|im_start|>{{ m.role }}\n
{%- if m.role == 'tool' and tools %}[{{ tools | length }} tools] {% endif %}
{{- m.content }}<|im_end|>\n{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}
"""


@pytest.fixture(scope="module")
def template_servers(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    devserver_workdir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, DevBackend]:
    """The scripted server with the tiny model's template, and two with other templates."""
    from tests.support.devserver import SCRIPT, SCRIPT_SPEC, start_devservers

    templates = tmp_path_factory.mktemp("templates")
    (templates / "qwen3.jinja").write_text(QWEN3_LIKE)
    (templates / "counting.jinja").write_text(COUNTING)
    (templates / "tool-aware.jinja").write_text(TOOL_AWARE)
    return start_devservers(
        request.config,
        tiny_model_dir,
        devserver_workdir,
        {
            "script": SCRIPT_SPEC,
            "qwen3-think": (SCRIPT, ["--chat-template", str(templates / "qwen3.jinja")]),
            "counting": (SCRIPT, ["--chat-template", str(templates / "counting.jinja")]),
            "tool-aware": (SCRIPT, ["--chat-template", str(templates / "tool-aware.jinja")]),
        },
    )


def text_of(done: Completion) -> str:
    return done.text.removesuffix("<|im_end|>")


async def tool_conversation(
    client: VLLMClient,
) -> tuple[list[tuple[list[int], Completion]], list[dict[str, Any]]]:
    """Three model calls: a tool call, its result, a user follow-up. Returns every call's
    (prompt ids, completion) and the conversation as messages."""
    templater = ChatTemplater(client)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "Count with tools: what is 1+2?"},
    ]
    ids = await templater.prompt_ids(messages, tools=TOOLS)
    calls = []
    for new in ([{"role": "tool", "content": "3"}], [{"role": "user", "content": "Thanks!"}], []):
        done = await client.complete(ids, max_tokens=64, seed=0)
        calls.append((ids, done))
        messages.append({"role": "assistant", "content": text_of(done)})
        if not new:
            break
        messages += new
        ids = ids + done.output_ids + await templater.continuation_ids(done.output_ids, new, TOOLS)
    return calls, messages


async def test_prompt_ids_are_the_models_own_template(
    template_servers: dict[str, DevBackend], tiny_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with template_servers["script"].client() as client:
        ids = await ChatTemplater(client).prompt_ids(messages, tools=TOOLS)
    expected = tiny_tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)


async def test_closing_ids_are_the_end_of_turn_marker_and_newline(
    template_servers: dict[str, DevBackend],
) -> None:
    async with template_servers["script"].client() as client:
        assert await ChatTemplater(client).closing_ids() == [IM_END, NEWLINE]


async def test_each_call_begins_with_the_previous_calls_prompt_and_output(
    template_servers: dict[str, DevBackend],
) -> None:
    async with template_servers["script"].client() as client:
        calls, _ = await tool_conversation(client)
    assert [text_of(done) for _, done in calls] == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "The sum is 3.",
        "I do not know.",
    ]
    for (ids, done), (next_ids, _) in itertools.pairwise(calls):
        assert next_ids[: len(ids) + len(done.output_ids)] == ids + done.output_ids


async def test_appended_ids_equal_the_template_render_of_the_whole_conversation(
    template_servers: dict[str, DevBackend],
) -> None:
    async with template_servers["script"].client() as client:
        calls, messages = await tool_conversation(client)
        # The last prompt as the template renders the finished conversation (minus the answer).
        rendered = await client.tokenize_chat(
            messages[:-1], add_generation_prompt=True, tools=TOOLS
        )
    assert calls[-1][0] == rendered


async def test_output_cut_before_its_end_of_turn_gets_the_whole_closing(
    template_servers: dict[str, DevBackend], tiny_tokenizer: Any
) -> None:
    async with template_servers["script"].client() as client:
        templater = ChatTemplater(client)
        ids = await templater.prompt_ids([{"role": "user", "content": "Spell it"}])
        by_stop = await client.complete(ids, max_tokens=64, stop=["STOP"])
        by_length = await client.complete(ids, max_tokens=2)
        after_stop = await templater.continuation_ids(by_stop.output_ids, [])
        after_length = await templater.continuation_ids(by_length.output_ids, [])
    assert by_stop.finish_reason == "stop" and IM_END not in by_stop.output_ids
    assert by_length.finish_reason == "length"
    generation_prompt = tiny_tokenizer.encode("<|im_start|>assistant\n")
    assert after_stop == after_length == [IM_END, NEWLINE, *generation_prompt]


async def test_qwen3_style_template_does_not_rewrite_earlier_reasoning(
    template_servers: dict[str, DevBackend], tiny_tokenizer: Any
) -> None:
    async with template_servers["qwen3-think"].client() as client:
        templater = ChatTemplater(client)
        first = [{"role": "user", "content": "Think first: capital?"}]
        ids = await templater.prompt_ids(first)
        done = await client.complete(ids, max_tokens=64, seed=0)
        follow_up = [{"role": "user", "content": "Are you sure?"}]
        appended = await templater.continuation_ids(done.output_ids, follow_up)
        sequence = ids + done.output_ids + appended
        re_rendered = await client.tokenize_chat(
            [*first, {"role": "assistant", "content": text_of(done)}, *follow_up],
            add_generation_prompt=True,
        )
    assert done.text == "<think>\nhmm\n</think>\n\nParis.<|im_end|>"
    # Only the closing newline and the new turn are appended; the reasoning stays as generated.
    new_turn = "<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    assert appended == [NEWLINE, *tiny_tokenizer.encode(new_turn)]
    # Re-rendering the history would have dropped it and forked the trajectory.
    assert re_rendered != sequence
    assert tiny_tokenizer.decode(re_rendered).count("<think>") == 0


async def test_template_that_rewrites_the_conversation_start_is_refused(
    template_servers: dict[str, DevBackend],
) -> None:
    async with template_servers["counting"].client() as client:
        templater = ChatTemplater(client)
        ids = await templater.prompt_ids([{"role": "user", "content": "Spell it"}])
        done = await client.complete(ids, max_tokens=64)
        with pytest.raises(TemplateError, match="prefix"):
            await templater.continuation_ids(done.output_ids, [{"role": "user", "content": "?"}])


async def test_tools_are_kept_when_they_shape_how_later_messages_render(
    template_servers: dict[str, DevBackend],
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with tools: 1+2?"}]
    tool_result = [{"role": "tool", "content": "3"}]
    async with template_servers["tool-aware"].client() as client:
        templater = ChatTemplater(client)
        ids = await templater.prompt_ids(messages, tools=TOOLS)
        done = await client.complete(ids, max_tokens=64, seed=0)
        continued = await templater.continuation_ids(done.output_ids, tool_result, TOOLS)
        whole = [*messages, {"role": "assistant", "content": text_of(done)}, *tool_result]
        rendered = await client.tokenize_chat(whole, add_generation_prompt=True, tools=TOOLS)
        shown = await client.detokenize(continued)
    assert ids + done.output_ids + continued == rendered
    assert "[1 tools] 3" in shown
