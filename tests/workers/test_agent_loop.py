"""The agent loop called directly: an in-memory policy and templater, the real `math` and `shell`
handlers, a fake tool server. No broker, no server, no tokenizer."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from core.schemas import Compaction, EnvTurn, ModelTurn
from routing.protocol import Completion, KnowsRefusedIds
from routing.vllm import OutOfVocabularyError
from workers.agent import Episode, Limits, run_episode
from workers.handlers.base import Handler
from workers.handlers.math import REMINDER as MATH_REMINDER
from workers.handlers.math import MathHandler
from workers.handlers.shell import REMINDER as SHELL_REMINDER
from workers.handlers.shell import ShellHandler
from workers.routed_policy import JobCancelled
from workers.tool_specs import ALL_TOOLS
from workers.trajectory import TrajectoryBuilder

PROMPT = [101, 102, 103, 104]
MATH_TASK = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}
SHELL_TASK = {"data_source": "shell", "instruction": "List the files.", "check": "true"}


# ----------------------------------------------------------------------------- fakes


@dataclass
class Say:
    """One scripted model call: the text, the exact ids it is made of, and how it ended."""

    text: str
    ids: list[int]
    finish: str = "stop"

    def completion(self, prompt_tokens: int) -> Completion:
        return Completion(
            output_ids=list(self.ids),
            logprobs=[-0.01 * (i + 1) for i in range(len(self.ids))],
            text=self.text,
            finish_reason=self.finish,
            stop_reason=None,
            prompt_tokens=prompt_tokens,
            backend_id="backend-a",
            policy_version=7,
        )


class FakePolicy:
    """A policy client (`routing.protocol.PolicyClient`) that plays a script of answers or
    errors and records every request."""

    def __init__(self, script: list[Say | BaseException], context: int = 4096) -> None:
        self.script = list(script)
        self.context = context
        self.requests: list[dict[str, Any]] = []

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Completion:
        self.requests.append(
            {
                "prompt_ids": list(prompt_ids),
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "seed": seed,
                "stop": stop,
            }
        )
        if not self.script:
            raise AssertionError("the loop asked the policy for more turns than scripted")
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step.completion(len(prompt_ids))

    async def max_model_len(self) -> int:
        return self.context


class RefusingPolicy(FakePolicy):
    """A policy client that knows its backend refuses every id at or above `vocab`."""

    def __init__(self, script: list[Say | BaseException], vocab: int) -> None:
        super().__init__(script)
        self.vocab = vocab
        self.asked: list[list[int]] = []

    def first_refused(self, ids: list[int]) -> int | None:
        self.asked.append(list(ids))
        return next((i for i in ids if i >= self.vocab), None)


class FakeTemplater:
    """Renders the first prompt as `PROMPT` and each continuation as `obs_len` fresh ids
    (60000, 60001, ... : never ids the model generates), recording what it was asked."""

    def __init__(self, obs_len: int = 3) -> None:
        self.obs_len = obs_len
        self.prompt_calls: list[tuple[list[dict[str, Any]], Any]] = []
        self.continuations: list[dict[str, Any]] = []
        self._next = 60_000

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        self.prompt_calls.append((messages, tools))
        return list(PROMPT)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        ids = list(range(self._next, self._next + self.obs_len))
        self._next += self.obs_len
        self.continuations.append(
            {"last_output_ids": list(last_output_ids), "messages": messages, "ids": ids}
        )
        return ids


@dataclass
class FakeTools:
    """The job's tool server: answers by tool name (a dict, or an exception to raise)."""

    answers: dict[str, dict[str, Any] | Exception] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def call(self, tool: str, **args: Any) -> dict[str, Any]:
        self.calls.append((tool, args))
        answer = self.answers.get(tool, {"output": ""})
        if isinstance(answer, Exception):
            raise answer
        return answer


def limits(**overrides: Any) -> Limits:
    values: dict[str, Any] = {"max_turns": 4, "max_total_tokens": 1000, "max_tokens": 50}
    values.update(overrides)
    return Limits(**values)


async def run_math(
    script: list[Say | BaseException],
    *,
    policy: FakePolicy | None = None,
    templater: FakeTemplater | None = None,
    saved: list[tuple[int, int]] | None = None,
    compaction: Compaction | None = None,
    **limit_overrides: Any,
) -> tuple[Episode, FakePolicy, FakeTemplater]:
    handler = MathHandler()
    policy = policy or FakePolicy(script)
    templater = templater or FakeTemplater()

    def on_turn(builder: TrajectoryBuilder) -> None:
        if saved is not None:
            saved.append((len(builder.turns), len(builder.response_ids)))

    episode = await run_episode(
        handler,
        MATH_TASK,
        handler.initial_messages(MATH_TASK),
        handler.tools(MATH_TASK),
        policy,
        templater,
        limits(**limit_overrides),
        on_turn=on_turn,
        compaction=compaction,
    )
    return episode, policy, templater


async def run_shell(
    script: list[Say | BaseException],
    tools: FakeTools | None,
    **limit_overrides: Any,
) -> tuple[Episode, FakePolicy, FakeTemplater]:
    handler: Handler = ShellHandler()
    policy = FakePolicy(script)
    templater = FakeTemplater()
    episode = await run_episode(
        handler,
        SHELL_TASK,
        handler.initial_messages(SHELL_TASK),
        handler.tools(SHELL_TASK),
        policy,
        templater,
        limits(**limit_overrides),
        runner=tools,
    )
    return episode, policy, templater


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def model_turn(episode: Episode, index: int) -> ModelTurn:
    turn = episode.builder.turns[index]
    assert isinstance(turn, ModelTurn)
    return turn


def mask_of(episode: Episode) -> list[int]:
    return episode.builder.loss_mask


# ----------------------------------------------------------------------------- stop reasons


async def test_an_answer_in_the_first_turn_ends_the_episode() -> None:
    episode, policy, templater = await run_math([Say("So \\boxed{4}.", [7, 8, 9])])
    assert (episode.stop_reason, episode.truncated) == ("answer", False)
    assert len(policy.requests) == 1
    assert policy.requests[0]["prompt_ids"] == PROMPT
    assert templater.continuations == []
    assert episode.builder.response_ids == [7, 8, 9]
    assert episode.builder.loss_mask == [1, 1, 1]
    assert episode.builder.logprobs == [-0.01, -0.02, -0.03]
    # The handler's first messages are what was rendered, once.
    assert templater.prompt_calls == [(MathHandler().initial_messages(MATH_TASK), None)]


async def test_a_turn_without_an_answer_gets_the_reminder_and_the_ids_are_appended_as_given() -> (
    None
):
    # The ids deliberately do not spell the text: the loop must pass them on untouched.
    episode, policy, templater = await run_math(
        [Say("Let me think.", [11, 12, 13]), Say("\\boxed{4}", [21, 22])]
    )
    assert episode.stop_reason == "answer"
    [continuation] = templater.continuations
    assert continuation["last_output_ids"] == [11, 12, 13]
    assert continuation["messages"] == [{"role": "user", "content": MATH_REMINDER}]
    observation = continuation["ids"]
    # Token in, token out: the second request is the first one plus the exact ids since.
    assert policy.requests[1]["prompt_ids"] == [*PROMPT, 11, 12, 13, *observation]
    builder = episode.builder
    assert builder.prompt_ids == PROMPT
    assert builder.response_ids == [11, 12, 13, *observation, 21, 22]
    assert builder.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1]
    assert builder.logprobs == [-0.01, -0.02, -0.03, None, None, None, -0.01, -0.02]
    model0, env, model1 = builder.turns
    assert isinstance(model0, ModelTurn) and isinstance(model1, ModelTurn)
    assert isinstance(env, EnvTurn)
    assert model0.prompt_ids == PROMPT and model1.prompt_ids == observation
    assert env.observation_ids == observation and env.text == MATH_REMINDER
    assert (model0.backend_id, model0.policy_version) == ("backend-a", 7)
    # Nothing already in the sequence was rendered again.
    assert len(templater.prompt_calls) == 1


async def test_max_turns_ends_the_episode_without_an_observation_after_the_last_turn() -> None:
    script: list[Say | BaseException] = [Say(f"hmm {i}", [10 + i]) for i in range(3)]
    episode, policy, templater = await run_math(script, max_turns=3)
    assert (episode.stop_reason, episode.truncated) == ("max_turns", False)
    assert len(policy.requests) == 3
    assert len(templater.continuations) == 2
    assert [t.type for t in episode.builder.turns] == ["model", "env", "model", "env", "model"]
    assert episode.builder.response_ids[-1] == 12


async def test_the_sampling_limits_reach_every_request() -> None:
    _, policy, _ = await run_math(
        [Say("x", [1]), Say("\\boxed{4}", [2])],
        temperature=0.6,
        top_p=0.9,
        seed=11,
        stop=["</answer>"],
    )
    for request in policy.requests:
        assert (request["temperature"], request["top_p"]) == (0.6, 0.9)
        assert (request["seed"], request["stop"]) == (11, ["</answer>"])


async def test_each_request_asks_for_no_more_than_the_tokens_left_in_the_budget() -> None:
    # Budget 20: after 5 generated and 4 observation ids, 11 are left (below max_tokens 16).
    episode, policy, _ = await run_math(
        [Say("x", [1, 2, 3, 4, 5]), Say("\\boxed{4}", [6])],
        templater=FakeTemplater(obs_len=4),
        max_total_tokens=20,
        max_tokens=16,
    )
    assert [r["max_tokens"] for r in policy.requests] == [16, 11]
    assert episode.stop_reason == "answer"


async def test_a_call_cut_by_the_budget_ends_the_episode_as_token_budget() -> None:
    episode, policy, _ = await run_math(
        [Say("long", list(range(1, 11)), finish="length")], max_total_tokens=10, max_tokens=100
    )
    assert policy.requests[0]["max_tokens"] == 10
    assert (episode.stop_reason, episode.truncated) == ("token_budget", True)
    assert mask_of(episode) == [1] * 10


async def test_an_observation_that_would_pass_the_budget_ends_the_episode_unappended() -> None:
    episode, _, templater = await run_math(
        [Say("x", [1, 2, 3])], templater=FakeTemplater(obs_len=5), max_total_tokens=8
    )
    assert (episode.stop_reason, episode.truncated) == ("token_budget", True)
    assert len(templater.continuations) == 1
    assert episode.builder.response_ids == [1, 2, 3]
    assert [t.type for t in episode.builder.turns] == ["model"]


async def test_a_call_cut_by_its_own_max_tokens_is_just_one_more_turn() -> None:
    episode, policy, _ = await run_math(
        [Say("cut", [1, 2, 3], finish="length"), Say("\\boxed{4}", [4])], max_tokens=3
    )
    assert episode.stop_reason == "answer"
    assert len(policy.requests) == 2
    assert model_turn(episode, 0).finish_reason == "length"


async def test_a_prompt_that_fills_the_context_ends_before_any_call() -> None:
    policy = FakePolicy([], context=len(PROMPT))
    episode, _, _ = await run_math([], policy=policy)
    assert (episode.stop_reason, episode.truncated) == ("context_length", True)
    assert policy.requests == []
    assert episode.builder.sequence == PROMPT
    assert episode.builder.turns == []


async def test_a_call_cut_by_the_context_ends_the_episode_as_context_length() -> None:
    room = 20 - len(PROMPT)
    policy = FakePolicy([Say("long", list(range(1, room + 1)), finish="length")], context=20)
    episode, _, _ = await run_math([], policy=policy, max_tokens=100)
    assert policy.requests[0]["max_tokens"] == room
    assert (episode.stop_reason, episode.truncated) == ("context_length", True)


async def test_an_observation_that_would_fill_the_context_ends_the_episode() -> None:
    # 4 prompt + 4 generated + 4 observation ids reach a context of 12.
    policy = FakePolicy([Say("x", [1, 2, 3, 4])], context=12)
    episode, _, templater = await run_math([], policy=policy, templater=FakeTemplater(obs_len=4))
    assert (episode.stop_reason, episode.truncated) == ("context_length", True)
    assert len(templater.continuations) == 1
    assert episode.builder.response_ids == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- invalid ids


async def test_a_generated_id_the_backend_is_known_to_refuse_ends_the_episode_before_sending() -> (
    None
):
    policy = RefusingPolicy([Say("x", [5, 1500, 6]), Say("\\boxed{4}", [7])], vocab=1000)
    episode, _, _ = await run_math([], policy=policy)
    assert (episode.stop_reason, episode.truncated) == ("invalid_token", False)
    assert len(policy.requests) == 1
    # The id stays in the trajectory as the backend returned it.
    assert 1500 in episode.builder.response_ids
    # Only generated ids are asked about (observation ids are the template's).
    assert policy.asked == [[5, 1500, 6]]
    assert isinstance(policy, KnowsRefusedIds)


async def test_observation_ids_above_the_vocabulary_do_not_count_as_generated() -> None:
    # The templater's ids (60000+) are above the vocabulary; the model's are not.
    policy = RefusingPolicy([Say("x", [5]), Say("\\boxed{4}", [7])], vocab=1000)
    episode, _, _ = await run_math([], policy=policy)
    assert episode.stop_reason == "answer"
    assert len(policy.requests) == 2


async def test_a_prompt_refused_for_a_generated_id_ends_the_episode_as_invalid_token() -> None:
    refusal = OutOfVocabularyError(
        "Token id 1500 is out of vocabulary (size 1000)", token_id=1500, vocab_size=1000, status=400
    )
    episode, policy, _ = await run_math([Say("x", [5, 1500]), refusal])
    assert (episode.stop_reason, episode.truncated) == ("invalid_token", False)
    assert len(policy.requests) == 2
    assert episode.builder.model_turns == 1


async def test_a_prompt_refused_for_an_id_the_model_did_not_generate_is_raised() -> None:
    refusal = OutOfVocabularyError(
        "Token id 60001 is out of vocabulary", token_id=60001, vocab_size=None, status=400
    )
    with pytest.raises(OutOfVocabularyError):
        await run_math([Say("x", [5, 6]), refusal])


# ----------------------------------------------------------------------------- tool calls


async def test_tool_calls_are_run_in_order_and_malformed_ones_are_counted() -> None:
    text = (
        "Looking.\n"
        + call("bash", command="ls")
        + "<tool_call>{not json}</tool_call>"
        + call("web_search", query="x")
        + call("bash", command="sleep 5", timeout=2)
    )
    tools = FakeTools({"bash": {"output": "a.txt\n", "exit_code": 0}})
    episode, policy, templater = await run_shell(
        [Say(text, [1, 2, 3]), Say(call("finish"), [4])], tools, tool_timeout=30.0
    )
    assert (episode.stop_reason, episode.truncated) == ("finish", False)
    # Declared calls run on the tool server, the default timeout added where none was given.
    assert tools.calls == [
        ("bash", {"command": "ls", "timeout": 30.0}),
        ("bash", {"command": "sleep 5", "timeout": 2}),
    ]
    [continuation] = templater.continuations
    replies = continuation["messages"]
    assert [m["role"] for m in replies] == ["tool"] * 4
    assert replies[0]["content"].startswith("Error: the tool call is not valid JSON")
    assert replies[1]["content"] == "a.txt\n"
    assert replies[2]["content"] == (
        "Error: there is no tool 'web_search'; the tools are: bash, editor, finish, ipython"
    )
    assert replies[3]["content"] == "a.txt\n"
    assert continuation["last_output_ids"] == [1, 2, 3]
    builder = episode.builder
    assert builder.malformed_tool_calls == 1
    assert [c["name"] for c in model_turn(episode, 0).tool_calls] == ["bash", "web_search", "bash"]
    assert builder.loss_mask == [1, 1, 1, 0, 0, 0, 1]
    # The tools were declared to the template.
    assert templater.prompt_calls[0][1] == ALL_TOOLS
    assert policy.requests[1]["prompt_ids"] == PROMPT + [1, 2, 3] + continuation["ids"]


async def test_every_kind_of_malformed_call_is_an_error_the_model_reads() -> None:
    text = (
        "<tool_call>[1, 2]</tool_call>"
        + '<tool_call>{"name": "bash", "arguments": 5}</tool_call>'
        + "<tool_call>"
        + '{"name": "bash", "arguments": {"command": "ls"}'
    )
    tools = FakeTools()
    episode, _, templater = await run_shell([Say(text, [1]), Say(call("finish"), [2])], tools)
    assert episode.builder.malformed_tool_calls == 3
    assert tools.calls == []
    replies = templater.continuations[0]["messages"]
    assert len(replies) == 3
    assert all(m["content"].startswith("Error: ") for m in replies)
    assert "not closed" in replies[2]["content"]


async def test_a_tool_that_fails_is_reported_to_the_model_not_raised() -> None:
    tools = FakeTools({"bash": RuntimeError("the shell is gone")})
    episode, _, templater = await run_shell(
        [Say(call("bash", command="ls"), [1]), Say(call("finish"), [2])], tools
    )
    assert episode.stop_reason == "finish"
    assert templater.continuations[0]["messages"] == [
        {"role": "tool", "content": "Error: the shell is gone"}
    ]


async def test_calls_after_finish_are_not_run() -> None:
    text = call("bash", command="touch a") + call("finish") + call("bash", command="rm -rf a")
    tools = FakeTools()
    episode, _, templater = await run_shell([Say(text, [1, 2])], tools)
    assert episode.stop_reason == "finish"
    assert tools.calls == [("bash", {"command": "touch a", "timeout": 120.0})]
    assert templater.continuations == []


async def test_a_turn_without_calls_goes_to_the_handler_which_asks_for_more() -> None:
    tools = FakeTools()
    episode, _, templater = await run_shell(
        [Say("I will look around.", [1]), Say("Still thinking.", [2])], tools, max_turns=2
    )
    assert (episode.stop_reason, episode.truncated) == ("max_turns", False)
    assert tools.calls == []
    assert templater.continuations[0]["messages"] == [{"role": "user", "content": SHELL_REMINDER}]


async def test_without_a_tool_server_a_call_is_answered_with_an_error() -> None:
    episode, _, templater = await run_shell(
        [Say(call("bash", command="ls"), [1]), Say(call("finish"), [2])], None
    )
    assert episode.stop_reason == "finish"
    [reply] = templater.continuations[0]["messages"]
    assert reply["content"].startswith("Error: there is no tool 'bash'")


async def test_without_declared_tools_a_tool_call_is_plain_text_for_the_handler() -> None:
    episode, _, _ = await run_math(
        [Say(call("bash", command="ls") + " so \\boxed{4}", [1])], max_turns=1
    )
    assert episode.stop_reason == "answer"
    assert model_turn(episode, 0).tool_calls == []
    assert episode.builder.malformed_tool_calls == 0


# ----------------------------------------------------------------------------- saving


async def test_the_builder_is_handed_on_after_every_model_and_environment_turn() -> None:
    saved: list[tuple[int, int]] = []
    episode, _, _ = await run_math(
        [Say("a", [1, 2]), Say("b", [3]), Say("\\boxed{4}", [4])], saved=saved
    )
    # (turns, response ids) as seen by each save: model, env, model, env, model.
    assert saved == [(1, 2), (2, 5), (3, 6), (4, 9), (5, 10)]
    assert len(episode.builder.turns) == 5


async def test_an_error_mid_episode_propagates_after_the_earlier_turns_were_saved() -> None:
    saved: list[tuple[int, int]] = []
    with pytest.raises(JobCancelled):
        await run_math([Say("a", [1, 2]), JobCancelled("job j was cancelled")], saved=saved)
    assert saved == [(1, 2), (2, 5)]


# ----------------------------------------------------------------------------- time budget


class SlowPolicy(FakePolicy):
    """A policy whose every call takes `delay` seconds."""

    def __init__(self, script: list[Say | BaseException], delay: float) -> None:
        super().__init__(script)
        self.delay = delay

    async def complete(self, prompt_ids: list[int], **kwargs: Any) -> Completion:
        await asyncio.sleep(self.delay)
        return await super().complete(prompt_ids, **kwargs)


async def test_a_spent_time_budget_stops_the_episode_before_the_next_call() -> None:
    episode, policy, _ = await run_math([Say("x", [1])], deadline=time.monotonic() - 1)
    assert (episode.stop_reason, episode.truncated) == ("time_budget", True)
    assert policy.requests == []


async def test_a_model_call_running_past_the_time_budget_is_cut_off() -> None:
    slow = SlowPolicy([Say("hmm", [5]), Say("\\boxed{4}", [6])], delay=0.3)
    started = time.monotonic()
    episode, _, _ = await run_math([], policy=slow, deadline=time.monotonic() + 0.45)
    assert (episode.stop_reason, episode.truncated) == ("time_budget", True)
    assert episode.builder.response_ids[0] == 5  # the first turn is kept, the second cut
    assert [t.type for t in episode.builder.turns] == ["model", "env"]
    assert time.monotonic() - started < 30


@dataclass
class SleepyTools(FakeTools):
    """A tool server whose calls take as long as the timeout they were given."""

    async def call(self, tool: str, **args: Any) -> dict[str, Any]:
        self.calls.append((tool, args))
        await asyncio.sleep(float(args.get("timeout", 0)))
        return {"output": "", "exit_code": 0}


async def test_a_timeout_the_model_asks_for_is_bounded_by_the_tool_timeout() -> None:
    asked = [10**9, "forever", True, -1, float("nan"), 0, 5]
    text = "".join(call("bash", command="sleep 1", timeout=t) for t in asked[:3])
    text += "".join(call("ipython", code="1", timeout=t) for t in asked[3:])
    tools = FakeTools()
    await run_shell([Say(text, [1]), Say(call("finish"), [2])], tools, tool_timeout=30.0)
    # more than the bound, or not a positive number of seconds: the bound; less: as asked
    assert [args["timeout"] for _, args in tools.calls] == [30.0] * 6 + [5]


async def test_tool_time_counts_against_the_time_budget() -> None:
    """A tool call still running at the job's deadline is cut off there, and its timeout
    never reaches past the deadline."""
    tools = SleepyTools()
    started = time.monotonic()
    episode, policy, _ = await run_shell(
        [Say(call("bash", command="sleep 600"), [1]), Say(call("finish"), [2])],
        tools,
        tool_timeout=600.0,
        deadline=time.monotonic() + 0.5,
    )
    assert (episode.stop_reason, episode.truncated) == ("time_budget", True)
    assert len(policy.requests) == 1  # no call after the budget ran out
    assert tools.calls[0][1]["timeout"] <= 0.5
    assert time.monotonic() - started < 60
