"""The flattened token record of a trajectory, derived from its turns.

`TrajectoryBuilder` (workers) keeps the flattened arrays up to date turn by turn while the
agent loop needs them; the job store keeps only the turns and derives the arrays once, when a
trajectory is read or finished. Both follow the one rule written here.

A trajectory is one or more segments (`core.schemas.Segment`): a model turn whose
`segment_start` is set begins a new one, with its `prompt_ids` as the new segment's whole
prompt. The trajectory's own arrays are its first segment; `segments` holds the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from core.schemas import ModelTurn, Segment, Trajectory, Turn


class Flat(NamedTuple):
    """The loss-ready record of one segment: its prompt, then every id after it."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Every id after the prompt: model outputs and observations, in order."""
    loss_mask: list[int]
    """1 on model-generated ids, 0 on observation and template ids."""
    logprobs: list[float | None]
    """The logprob of each generated id, None where the mask is 0."""


def segment_starts(turns: Sequence[Turn]) -> list[int]:
    """The index of each segment's first turn: 0, then every model turn that begins one."""
    return [0] + [
        i
        for i, t in enumerate(turns)
        if i > 0 and isinstance(t, ModelTurn) and t.segment_start is not None
    ]


def _split(turns: Sequence[Turn]) -> list[tuple[int, Sequence[Turn]]]:
    starts = segment_starts(turns)
    ends = [*starts[1:], len(turns)]
    return [(s, turns[s:e]) for s, e in zip(starts, ends, strict=True)]


def first_prompt(turns: Sequence[Turn]) -> list[int]:
    """The first model call's prompt (empty when the trajectory starts with no model turn)."""
    return list(turns[0].prompt_ids) if turns and isinstance(turns[0], ModelTurn) else []


def response_length(turns: Sequence[Turn]) -> int:
    """How many ids the turns add after the prompt of the segment they begin."""
    return sum(
        len(t.output_ids) if isinstance(t, ModelTurn) else len(t.observation_ids) for t in turns
    )


def flatten(turns: Sequence[Turn]) -> Flat:
    """The flattened record of one segment's `turns`: a model turn adds its output ids (mask
    1, their logprobs), an environment turn its observation ids (mask 0, no logprob). A later
    model turn's `prompt_ids` are the observations before it, already counted, so they add
    nothing."""
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


def _segment(first: int, turns: Sequence[Turn]) -> Segment:
    flat = flatten(turns)
    head = turns[0] if turns else None
    reason = head.segment_start if isinstance(head, ModelTurn) and first > 0 else None
    return Segment(
        reason=reason or "start",
        first_turn=first,
        prompt_ids=flat.prompt_ids,
        response_ids=flat.response_ids,
        loss_mask=flat.loss_mask,
        logprobs=flat.logprobs,
        policy_versions=[t.policy_version for t in turns if isinstance(t, ModelTurn)],
    )


def split_segments(turns: Sequence[Turn]) -> list[Segment]:
    """Every segment of `turns`, the first included (reason `start`)."""
    return [_segment(first, part) for first, part in _split(turns)]


def derivable(trajectory: Trajectory) -> bool:
    """Whether the trajectory's flattened arrays and later segments are those its turns give
    (checked by the first prompt and the lengths: the builder keeps them so)."""
    parts = _split(trajectory.turns)
    first = parts[0][1]
    n = response_length(first)
    if not (
        trajectory.prompt_ids == first_prompt(first)
        and len(trajectory.response_ids) == n
        and len(trajectory.loss_mask) == n
        and len(trajectory.logprobs) == n
        and len(trajectory.segments) == len(parts) - 1
    ):
        return False
    return all(
        seg.first_turn == start and len(seg.response_ids) == response_length(part)
        for seg, (start, part) in zip(trajectory.segments, parts[1:], strict=True)
    )


def fill_flat(trajectory: Trajectory) -> Trajectory:
    """Set the trajectory's flattened arrays (its first segment) and its later segments from
    its turns."""
    first, *later = split_segments(trajectory.turns)
    trajectory.prompt_ids = first.prompt_ids
    trajectory.response_ids = first.response_ids
    trajectory.loss_mask = first.loss_mask
    trajectory.logprobs = first.logprobs
    trajectory.segments = later
    return trajectory


def sequences(trajectory: Trajectory) -> list[Segment]:
    """Every trainable sequence of the trajectory, in order: the first segment (its own
    arrays, reason `start`) and then its later `segments`."""
    versions = [t.policy_version for t in trajectory.turns if isinstance(t, ModelTurn)]
    if trajectory.segments:
        first_end = trajectory.segments[0].first_turn
        versions = [
            t.policy_version for t in trajectory.turns[:first_end] if isinstance(t, ModelTurn)
        ]
    first = Segment(
        reason="start",
        first_turn=0,
        prompt_ids=list(trajectory.prompt_ids),
        response_ids=list(trajectory.response_ids),
        loss_mask=list(trajectory.loss_mask),
        logprobs=list(trajectory.logprobs),
        policy_versions=versions,
    )
    return [first, *trajectory.segments]


def segments_and_turns(trajectory: Trajectory) -> list[tuple[Segment, list[Turn]]]:
    """Every segment of the trajectory (`sequences`, the first included) with the turns it is
    made of."""
    parts = sequences(trajectory)
    ends = [part.first_turn for part in parts[1:]] + [len(trajectory.turns)]
    return [
        (part, list(trajectory.turns[part.first_turn : end]))
        for part, end in zip(parts, ends, strict=True)
    ]
