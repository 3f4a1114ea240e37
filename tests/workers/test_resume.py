"""Going on from the last saved turn (`workers.resume`): an episode interrupted at any save
and resumed from what was saved ends with exactly the ids, mask and logprobs of the same
episode run in one go, calls the model only for the calls not saved, and runs no saved tool
call again."""

from __future__ import annotations

from typing import Any

import pytest

from core.schemas import EnvTurn, JobStatus, ModelTurn, Trajectory
from tests.workers.test_agent_loop import (
    MATH_TASK,
    SHELL_TASK,
    FakePolicy,
    FakeTemplater,
    FakeTools,
    Say,
    call,
    limits,
)
from workers.agent import Episode, run_episode
from workers.handlers.base import Handler
from workers.handlers.math import MathHandler
from workers.handlers.shell import ShellHandler
from workers.resume import restore
from workers.trajectory import TrajectoryBuilder

OBS = 3
"""Ids of each observation (`FakeTemplater`'s `obs_len`)."""


def shell_script(n: int) -> list[Say]:
    """`n` bash calls, then finish: each call's ids are its own (100*k + 1, 100*k + 2)."""
    script = [Say(call("bash", command=f"echo {k}"), [100 * k + 1, 100 * k + 2]) for k in range(n)]
    return [*script, Say(call("finish", result="done"), [999])]


def snapshot(builder: TrajectoryBuilder) -> Trajectory:
    """The trajectory as a save after this turn writes it."""
    trajectory = Trajectory(
        job_id="j", group_id="g", instance_id="i", data_source="shell", status=JobStatus.run
    )
    return builder.fill(trajectory).model_copy(deep=True)


async def play(
    handler: Handler,
    task: dict[str, Any],
    script: list[Say],
    tools: FakeTools | None,
    *,
    saves: list[Trajectory] | None = None,
    restored_from: Trajectory | None = None,
) -> tuple[Episode, FakePolicy]:
    policy = FakePolicy(script)
    templater = FakeTemplater(obs_len=OBS)
    messages, declared = handler.initial_messages(task), handler.tools(task)
    restored = None
    if restored_from is not None:
        # None: nothing to keep, the episode starts again (as RUN does then).
        restored = restore(restored_from, messages, declared, attempt=1)
        if restored is not None:
            # The fake templater numbers observations in order: on from the saved ones.
            templater._next += OBS * sum(isinstance(t, EnvTurn) for t in restored.stored.turns)
    episode = await run_episode(
        handler,
        task,
        messages,
        declared,
        policy,
        templater,
        limits(max_turns=12, max_total_tokens=10_000),
        on_turn=lambda b: None if saves is None else saves.append(snapshot(b)),
        runner=tools,
        restored=restored,
    )
    return episode, policy


def flat(episode: Episode) -> tuple[list[int], list[int], list[int], list[float | None]]:
    b = episode.builder
    return (b.prompt_ids, b.response_ids, b.loss_mask, b.logprobs)


async def test_a_shell_episode_resumed_at_any_save_ends_as_if_run_in_one_go() -> None:
    saves: list[Trajectory] = []
    whole_tools = FakeTools()
    whole, whole_policy = await play(
        ShellHandler(), SHELL_TASK, shell_script(4), whole_tools, saves=saves
    )
    assert whole.stop_reason == "finish" and len(whole_tools.calls) == 4
    # A save after each model call, and after each reply: four calls with replies, then finish.
    assert len(saves) == 9
    for at, saved in enumerate(saves):
        model_calls = sum(isinstance(t, ModelTurn) for t in saved.turns)
        # A saved last call with tool calls is made again: its tools may have run unsaved.
        last_is_call = isinstance(saved.turns[-1], ModelTurn) and bool(saved.turns[-1].tool_calls)
        kept_calls = model_calls - last_is_call
        tools = FakeTools()
        resumed, policy = await play(
            ShellHandler(), SHELL_TASK, shell_script(4)[kept_calls:], tools, restored_from=saved
        )
        assert flat(resumed) == flat(whole), f"resumed at save {at}"
        assert resumed.stop_reason == "finish"
        # The model is asked only for the calls that were not kept, with the same prompts.
        assert policy.requests == whole_policy.requests[kept_calls:]
        # No tool call runs twice: only those of the calls made again.
        assert tools.calls == whole_tools.calls[kept_calls:]
        assert [
            t.model_dump() for t in resumed.builder.turns[: len(saved.turns) - last_is_call]
        ] == [t.model_dump() for t in saved.turns[: len(saved.turns) - last_is_call]]


async def test_a_saved_answer_without_its_reply_is_read_again_not_asked_again() -> None:
    script = [Say("Let me think.", [11, 12]), Say("Still thinking.", [13]), Say("\\boxed{4}", [14])]
    saves: list[Trajectory] = []
    whole, whole_policy = await play(MathHandler(), MATH_TASK, script, None, saves=saves)
    assert whole.stop_reason == "answer"
    # The save right after the second call, before the handler's reminder was appended.
    second_call = saves[2]
    assert isinstance(second_call.turns[-1], ModelTurn)
    resumed, policy = await play(
        MathHandler(), MATH_TASK, script[2:], None, restored_from=second_call
    )
    assert flat(resumed) == flat(whole)
    assert policy.requests == whole_policy.requests[2:]


def test_what_restore_reports_and_refuses() -> None:
    builder = TrajectoryBuilder([1, 2, 3])
    ls, rm = {"command": "ls"}, {"command": "rm -rf x"}
    builder.add_model_turn([4, 5], [-0.1, -0.2], call("bash", **ls), "stop", 0.1,
                           tool_calls=[{"name": "bash", "arguments": ls}])  # fmt: skip
    builder.add_env_turn([60_000, 60_001, 60_002], "a.txt")
    builder.add_model_turn([6], [-0.3], call("bash", **rm), "stop", 0.1,
                           tool_calls=[{"name": "bash", "arguments": rm}])  # fmt: skip
    saved = snapshot(builder)
    handler = ShellHandler()
    restored = restore(saved, handler.initial_messages(SHELL_TASK), handler.tools(SHELL_TASK), 2)
    assert restored is not None
    assert (restored.first_turn, restored.pending) == (1, None)
    resume = restored.resume
    assert (resume.turn, resume.dropped_turns, resume.reprefill_ids, resume.attempt) == (
        2,
        1,
        3 + 2 + 3,
        2,
    )
    # Nothing to keep: only a call whose tools may have run.
    first_only = snapshot(builder)
    first_only.turns = first_only.turns[:1]
    assert restore(first_only, [], handler.tools(SHELL_TASK)) is None
    # Not the built-in loop's one segment: started again instead.
    segmented = saved.model_copy(deep=True)
    segmented.turns[2].tool_calls = []  # type: ignore[union-attr]
    segmented.turns[2].segment_start = "rerendered"  # type: ignore[union-attr]
    assert restore(segmented, [], handler.tools(SHELL_TASK)) is None
    # Turns that are not one record (a prompt that does not follow) are not gone on with.
    broken = saved.model_copy(deep=True)
    broken.turns[2].tool_calls = []  # type: ignore[union-attr]
    broken.turns[2].prompt_ids = [42]  # type: ignore[union-attr]
    assert restore(broken, [], None) is None


@pytest.mark.parametrize("cut", ["length"])
def test_a_saved_last_call_cut_by_its_bound_is_made_again(cut: str) -> None:
    builder = TrajectoryBuilder([1, 2])
    builder.add_model_turn([3], [-0.1], "thinking", "stop", 0.1)
    builder.add_env_turn([60_000], "go on")
    builder.add_model_turn([4], [-0.2], "more", cut, 0.1)
    restored = restore(snapshot(builder), [], None)
    assert restored is not None
    assert (restored.resume.dropped_turns, restored.first_turn, restored.pending) == (1, 1, None)
