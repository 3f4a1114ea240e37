"""The trajectory builder on its own: turns appended as ids, flattened for the loss."""

from __future__ import annotations

import pytest

from core.schemas import EnvTurn, JobStatus, ModelTurn, Trajectory
from workers.trajectory import TrajectoryBuilder


def blank_trajectory() -> Trajectory:
    return Trajectory(
        job_id="j-1",
        group_id="g-1",
        instance_id="i-1",
        data_source="math",
        status=JobStatus.run,
    )


def assert_aligned(builder: TrajectoryBuilder) -> None:
    """The flattened record agrees with the turns it was built from."""
    assert len(builder.response_ids) == len(builder.loss_mask) == len(builder.logprobs)
    rebuilt: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    sent: list[int] = []
    for turn in builder.turns:
        if isinstance(turn, ModelTurn):
            sent.extend(turn.prompt_ids)
            sent.extend(turn.output_ids)
            rebuilt.extend(turn.output_ids)
            mask.extend([1] * len(turn.output_ids))
            logprobs.extend(turn.logprobs)
        else:
            rebuilt.extend(turn.observation_ids)
            mask.extend([0] * len(turn.observation_ids))
            logprobs.extend([None] * len(turn.observation_ids))
    assert builder.response_ids == rebuilt
    assert builder.loss_mask == mask
    assert builder.logprobs == logprobs
    assert builder.sequence == builder.prompt_ids + builder.response_ids
    assert builder.sequence_length == len(builder.sequence)
    # What the model calls were sent, turn by turn, is a prefix of the sequence.
    assert builder.sequence[: len(sent)] == sent


def test_an_empty_episode_is_its_prompt_alone() -> None:
    builder = TrajectoryBuilder([5, 6, 7])
    assert builder.sequence == [5, 6, 7]
    assert builder.sequence_length == 3
    assert builder.model_turns == 0
    assert builder.assistant_texts == []
    trajectory = builder.fill(blank_trajectory())
    assert trajectory.prompt_ids == [5, 6, 7]
    assert trajectory.response_ids == []
    assert trajectory.loss_mask == []
    assert trajectory.logprobs == []
    assert trajectory.turns == []
    assert trajectory.tool_calls == 0
    assert trajectory.malformed_tool_calls == 0
    assert (trajectory.timing.llm, trajectory.timing.tools) == (0.0, 0.0)


def test_one_model_turn_is_masked_in_and_carries_the_first_prompt() -> None:
    builder = TrajectoryBuilder([1, 2, 3])
    turn = builder.add_model_turn([10, 11], [-0.5, -0.25], "hi", "stop", llm_seconds=0.5)
    assert turn.prompt_ids == [1, 2, 3]
    assert turn.output_ids == [10, 11]
    assert turn.finish_reason == "stop"
    assert builder.response_ids == [10, 11]
    assert builder.loss_mask == [1, 1]
    assert builder.logprobs == [-0.5, -0.25]
    assert builder.sequence == [1, 2, 3, 10, 11]
    assert builder.assistant_texts == ["hi"]
    assert_aligned(builder)


def test_a_multi_turn_episode_flattens_in_order_with_observations_masked_out() -> None:
    builder = TrajectoryBuilder([1, 2])
    builder.add_model_turn(
        [10, 11, 12],
        [-0.1, -0.2, -0.3],
        "first",
        "stop",
        llm_seconds=1.0,
        tool_calls=[{"name": "bash", "arguments": {"command": "ls"}}],
    )
    builder.add_env_turn([90, 91], "obs one", tool_seconds=0.25)
    second = builder.add_model_turn([20], [-1.5], "second", "length", llm_seconds=2.0)
    builder.add_env_turn([92, 93, 94], "obs two", tool_seconds=0.5)
    third = builder.add_model_turn(
        [30, 31],
        [-0.7, -0.8],
        "third",
        "stop",
        llm_seconds=0.5,
        tool_calls=[
            {"name": "editor", "arguments": {}},
            {"name": "finish", "arguments": {}},
        ],
    )
    builder.malformed_tool_calls = 2

    assert builder.response_ids == [10, 11, 12, 90, 91, 20, 92, 93, 94, 30, 31]
    assert builder.loss_mask == [1, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    assert builder.logprobs == [-0.1, -0.2, -0.3, None, None, -1.5, None, None, None, -0.7, -0.8]
    # Each model call records only the ids added since the previous one.
    assert second.prompt_ids == [90, 91]
    assert third.prompt_ids == [92, 93, 94]
    assert [t.type for t in builder.turns] == ["model", "env", "model", "env", "model"]
    assert builder.model_turns == 3
    assert builder.assistant_texts == ["first", "second", "third"]
    assert builder.llm_seconds == pytest.approx(3.5)
    assert builder.tool_seconds == pytest.approx(0.75)
    assert_aligned(builder)

    trajectory = builder.fill(blank_trajectory())
    assert trajectory.prompt_ids == [1, 2]
    assert trajectory.response_ids == builder.response_ids
    assert trajectory.loss_mask == builder.loss_mask
    assert trajectory.logprobs == builder.logprobs
    assert len(trajectory.turns) == 5
    assert trajectory.tool_calls == 3
    assert trajectory.malformed_tool_calls == 2
    assert trajectory.timing.llm == pytest.approx(3.5)
    assert trajectory.timing.tools == pytest.approx(0.75)
    # The ids and status are the caller's: fill leaves them alone.
    assert (trajectory.job_id, trajectory.status) == ("j-1", JobStatus.run)


def test_observations_in_a_row_all_go_to_the_next_model_calls_prompt() -> None:
    builder = TrajectoryBuilder([1])
    builder.add_model_turn([10], [-0.1], "a", "stop", llm_seconds=0.0)
    builder.add_env_turn([90], "one")
    builder.add_env_turn([91, 92], "two")
    turn = builder.add_model_turn([11], [-0.2], "b", "stop", llm_seconds=0.0)
    assert turn.prompt_ids == [90, 91, 92]
    assert builder.loss_mask == [1, 0, 0, 0, 1]
    assert_aligned(builder)


def test_an_observation_before_any_model_call_joins_the_first_prompt_of_the_turn() -> None:
    builder = TrajectoryBuilder([1, 2])
    builder.add_env_turn([90], "preamble")
    turn = builder.add_model_turn([10], [-0.1], "a", "stop", llm_seconds=0.0)
    assert turn.prompt_ids == [1, 2, 90]
    assert builder.prompt_ids == [1, 2]
    assert builder.response_ids == [90, 10]
    assert builder.loss_mask == [0, 1]


def test_output_ids_and_logprobs_of_different_lengths_are_refused_and_nothing_is_added() -> None:
    builder = TrajectoryBuilder([1, 2])
    with pytest.raises(ValueError, match="2 output ids but 1 logprobs"):
        builder.add_model_turn([10, 11], [-0.1], "x", "stop", llm_seconds=0.0)
    assert builder.turns == []
    assert builder.response_ids == builder.loss_mask == builder.logprobs == []
    assert builder.llm_seconds == 0.0


def test_the_record_is_copied_not_shared() -> None:
    prompt = [1, 2]
    output = [10, 11]
    observation = [90]
    builder = TrajectoryBuilder(prompt)
    first = builder.add_model_turn(output, [-0.1, -0.2], "a", "stop", llm_seconds=0.0)
    builder.add_env_turn(observation, "obs")
    prompt.append(3)
    output.append(12)
    observation.append(91)
    assert builder.prompt_ids == [1, 2]
    assert first.prompt_ids == [1, 2]
    assert first.output_ids == [10, 11]
    assert builder.response_ids == [10, 11, 90]

    trajectory = builder.fill(blank_trajectory())
    builder.add_model_turn([20], [-0.3], "b", "stop", llm_seconds=0.0)
    assert trajectory.response_ids == [10, 11, 90]
    assert len(trajectory.turns) == 2


def test_the_filled_trajectory_survives_json_with_nulls_where_the_mask_is_zero() -> None:
    builder = TrajectoryBuilder([1])
    builder.add_model_turn([10], [-0.5], "a", "stop", llm_seconds=0.0)
    builder.add_env_turn([90, 91], "obs")
    trajectory = builder.fill(blank_trajectory())
    again = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert again.logprobs == [-0.5, None, None]
    assert again.loss_mask == [1, 0, 0]
    assert isinstance(again.turns[0], ModelTurn)
    assert isinstance(again.turns[1], EnvTurn)
    assert again.turns[1].observation_ids == [90, 91]
