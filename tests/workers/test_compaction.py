"""Context compaction in the agent loop (`agent.compaction`), called directly with the fakes of
test_agent_loop: the policy writes the summary as a turn of its own, the episode goes on from
[the task, the summary, the recent turns] as a new segment, and every id stays exact."""

from __future__ import annotations

from typing import Any

import pytest

from core.flatten import sequences
from core.schemas import Compaction, ModelTurn, Trajectory
from tests.support.segments import total_ids
from tests.workers.test_agent_loop import (
    MATH_REMINDER,
    MATH_TASK,
    PROMPT,
    FakePolicy,
    FakeTemplater,
    Say,
    limits,
    run_math,
)
from tests.workers.test_resume import snapshot
from workers.agent import Episode, run_episode
from workers.compaction import COMPACTION, SUMMARY_PREFIX
from workers.handlers.math import MathHandler
from workers.resume import Restored, restore

pytestmark = pytest.mark.compaction

THINK = [Say(f"Thinking, step {k}.", [10 * k + 1, 10 * k + 2, 10 * k + 3]) for k in range(1, 9)]
SUMMARY = Say("I tried steps one to three.", [901, 902])
ANSWER = Say("So \\boxed{4}.", [77])


def small(**fields: Any) -> Compaction:
    """A plan with a threshold below what a request may ask (32): these prompts are tiny."""
    return Compaction.model_construct(**fields)


class SizedTemplater(FakeTemplater):
    """Renders a whole prompt as two ids per message (so what a new segment keeps shows)."""

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        self.prompt_calls.append((messages, tools))
        return [500 + i for i in range(2 * len(messages))]


async def run(
    script: list[Say],
    plan: Compaction,
    templater: FakeTemplater | None = None,
    context: int = 4096,
    max_turns: int = 10,
) -> tuple[Episode, FakePolicy, FakeTemplater]:
    return await run_math(
        list(script),
        policy=FakePolicy(list(script), context),
        templater=templater,
        compaction=plan,
        max_turns=max_turns,
    )


def segments_of(episode: Episode) -> Trajectory:
    trajectory = Trajectory(
        job_id="j", group_id="g", instance_id="i", data_source="math", status="run"
    )
    return episode.builder.fill(trajectory)


async def test_past_the_threshold_the_policy_summarises_and_a_segment_begins() -> None:
    # Prompt 4 ids; each thought 3 ids and a reminder 3 ids: after two turns the sequence is
    # 16 ids, past the threshold of 15.
    plan = small(threshold=15, keep_turns=1, instruction="Summarise.")
    episode, policy, templater = await run([*THINK[:2], SUMMARY, ANSWER], plan)
    assert episode.stop_reason == "answer"
    traj = segments_of(episode)
    [segment] = traj.segments
    assert segment.reason == COMPACTION
    turns = episode.builder.turns
    summary = [t for t in turns if isinstance(t, ModelTurn) and t.text == SUMMARY.text]
    assert len(summary) == 1
    # The summary request: the instruction appended after the conversation, as ids (mask 0),
    # and the summary generated (mask 1, with its logprobs) in the first segment.
    reminder = {"role": "user", "content": MATH_REMINDER}
    assert templater.continuations[-1]["messages"] == [
        reminder,
        {"role": "user", "content": "Summarise."},
    ]
    asked = templater.continuations[-1]["ids"]
    assert traj.response_ids[-len(asked) - 2 :] == [*asked, 901, 902]
    assert traj.loss_mask[-len(asked) - 2 :] == [0] * len(asked) + [1, 1]
    # The new segment's prompt: the task, the summary, the most recent turn and its reply.
    messages, _ = templater.prompt_calls[-1]
    first = MathHandler().initial_messages(MATH_TASK)
    assert messages[: len(first)] == first
    assert messages[len(first)] == {"role": "user", "content": SUMMARY_PREFIX + SUMMARY.text}
    assert messages[len(first) + 1] == {"role": "assistant", "content": THINK[1].text}
    assert len(messages) == len(first) + 3  # the reminder that followed it
    # The call after it was sent exactly that prompt, and its ids begin the segment.
    assert policy.requests[-1]["prompt_ids"] == PROMPT
    assert segment.prompt_ids == PROMPT and segment.response_ids == [77]
    assert segment.loss_mask == [1] and segment.logprobs == [-0.01]


async def test_turns_that_would_not_fit_under_the_threshold_are_left_out() -> None:
    # Two ids per message: the task's messages and the summary, then four per kept turn (its
    # reply and the reminder). Room under the threshold for one kept turn of the three asked.
    first = MathHandler().initial_messages(MATH_TASK)
    plan = small(threshold=2 * len(first) + 2 + 4 + 1, keep_turns=3)
    episode, _, templater = await run([*THINK[:2], SUMMARY, ANSWER], plan, SizedTemplater())
    messages, _ = templater.prompt_calls[-1]
    assert len(messages) == len(first) + 1 + 2
    assert messages[-2] == {"role": "assistant", "content": THINK[1].text}
    assert [s.reason for s in segments_of(episode).segments] == [COMPACTION]


async def test_an_episode_several_contexts_long_keeps_every_segment_within_the_window() -> None:
    context = 40
    # Thoughts that never answer: the episode runs to max_turns, compacting as it goes.
    thoughts = [Say(f"Thought {k}.", [k + 1, k + 2, k + 3]) for k in range(40)]
    plan = small(threshold=16, keep_turns=1, instruction="Sum up.", max_summary_tokens=4)
    episode, policy, _ = await run(thoughts, plan, context=context, max_turns=12)
    assert episode.stop_reason == "max_turns"
    traj = segments_of(episode)
    parts = [(traj.prompt_ids, traj.response_ids)]
    parts += [(s.prompt_ids, s.response_ids) for s in traj.segments]
    assert len(traj.segments) >= 4 and total_ids(traj) > 2 * context
    assert all(len(p) + len(r) <= context for p, r in parts)
    assert {s.reason for s in traj.segments} == {COMPACTION}
    # Twelve turns of the agent, and one summary call per compaction besides.
    assert len(policy.requests) == 12 + len(traj.segments)
    assert sum(r["max_tokens"] == 4 for r in policy.requests) == len(traj.segments)


def test_compaction_is_refused_with_a_harness_of_ones_own() -> None:
    from core.schemas import AgentParams, SessionRequest

    with pytest.raises(ValueError, match="built-in agent loop"):
        AgentParams.model_validate({"command": "python agent.py", "compaction": {"threshold": 64}})
    with pytest.raises(ValueError, match="threshold"):
        AgentParams.model_validate({"compaction": {"threshold": 8}})
    with pytest.raises(ValueError, match=r"leave out agent\.compaction"):
        SessionRequest.model_validate(
            {"task": MATH_TASK, "agent": {"compaction": {"threshold": 64}}}
        )


async def test_an_episode_resumed_before_it_compacts_compacts_as_one_run_would() -> None:
    handler = MathHandler()
    first, tools = handler.initial_messages(MATH_TASK), handler.tools(MATH_TASK)
    plan = small(threshold=15, keep_turns=1, instruction="Summarise.", max_summary_tokens=512)
    script = [*THINK[:2], SUMMARY, ANSWER]

    async def play(
        said: list[Say], restored: Restored | None, saves: list[Trajectory] | None = None
    ) -> tuple[Episode, FakeTemplater]:
        templater = FakeTemplater()
        if restored is not None:
            templater._next += 3 * sum(t.type == "env" for t in restored.stored.turns)
        episode = await run_episode(
            handler, MATH_TASK, first, tools, FakePolicy(said), templater, limits(max_turns=10),
            on_turn=lambda b: None if saves is None else saves.append(snapshot(b)),
            restored=restored, compaction=plan,
        )  # fmt: skip
        return episode, templater

    saves: list[Trajectory] = []
    whole, _ = await play(script, None, saves)
    # Saved after the first turn's reply; the worker died during the second call.
    saved = saves[1]
    restored = restore(saved, first, tools, attempt=1)
    assert restored is not None and restored.first_turn == 1
    resumed, templater = await play(script[1:], restored)

    def ids(episode: Episode) -> list[tuple[Any, ...]]:
        return [
            (s.reason, s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs)
            for s in sequences(segments_of(episode))
        ]

    assert ids(resumed) == ids(whole) and len(ids(whole)) == 2
    # The compacted segment begins with the task's first messages, not the resumed history.
    messages, _ = templater.prompt_calls[-1]
    assert messages[: len(first)] == first and len(messages) == len(first) + 3
