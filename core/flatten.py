"""The flattened token record of a trajectory, derived from its turns.

`TrajectoryBuilder` (workers) keeps the flattened arrays up to date turn by turn while the
agent loop needs them; the job store keeps only the turns and derives the arrays once, when a
trajectory is read or finished. Both follow the one rule written here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from core.schemas import ModelTurn, Trajectory, Turn


class Flat(NamedTuple):
    """The loss-ready record: the first prompt, then every id after it."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Every id after the first prompt: model outputs and observations, in order."""
    loss_mask: list[int]
    """1 on model-generated ids, 0 on observation and template ids."""
    logprobs: list[float | None]
    """The logprob of each generated id, None where the mask is 0."""


def first_prompt(turns: Sequence[Turn]) -> list[int]:
    """The first model call's prompt (empty when the trajectory starts with no model turn)."""
    return list(turns[0].prompt_ids) if turns and isinstance(turns[0], ModelTurn) else []


def response_length(turns: Sequence[Turn]) -> int:
    """How many ids the turns add after the first prompt."""
    return sum(
        len(t.output_ids) if isinstance(t, ModelTurn) else len(t.observation_ids) for t in turns
    )


def flatten(turns: Sequence[Turn]) -> Flat:
    """The flattened record of `turns`: a model turn adds its output ids (mask 1, their
    logprobs), an environment turn its observation ids (mask 0, no logprob). A later model
    turn's `prompt_ids` are the observations before it, already counted, so they add nothing."""
    flat = Flat(first_prompt(turns), [], [], [])
    for turn in turns:
        if isinstance(turn, ModelTurn):
            flat.response_ids.extend(turn.output_ids)
            flat.loss_mask.extend([1] * len(turn.output_ids))
            flat.logprobs.extend(turn.logprobs)
        else:
            flat.response_ids.extend(turn.observation_ids)
            flat.loss_mask.extend([0] * len(turn.observation_ids))
            flat.logprobs.extend([None] * len(turn.observation_ids))
    return flat


def derivable(trajectory: Trajectory) -> bool:
    """Whether the trajectory's flattened arrays are those `flatten` gives for its turns
    (checked by the first prompt and the lengths: the builder keeps them so)."""
    n = response_length(trajectory.turns)
    return (
        trajectory.prompt_ids == first_prompt(trajectory.turns)
        and len(trajectory.response_ids) == n
        and len(trajectory.loss_mask) == n
        and len(trajectory.logprobs) == n
    )


def fill_flat(trajectory: Trajectory) -> Trajectory:
    """Set the trajectory's flattened arrays from its turns."""
    flat = flatten(trajectory.turns)
    trajectory.prompt_ids = flat.prompt_ids
    trajectory.response_ids = flat.response_ids
    trajectory.loss_mask = flat.loss_mask
    trajectory.logprobs = flat.logprobs
    return trajectory
