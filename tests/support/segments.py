"""Checks of a trajectory's segments against the model that generated them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.client import RolloutClient
from core.flatten import sequences
from core.schemas import JobStatus, Trajectory
from tests.support.weights import max_diff, teacher_forced


def compacted_episode(
    client: RolloutClient,
    task: dict[str, Any],
    compaction: dict[str, Any],
    *,
    seed: int,
    max_tokens: int,
    max_turns: int,
    timeout: float,
) -> Trajectory:
    """A completed episode of `task` sampled at temperature 1 with `agent.compaction`."""
    trajectory = client.submit_rollout(
        task,
        sampling={"seed": seed, "max_tokens": max_tokens, "temperature": 1.0},
        agent={"max_turns": max_turns, "max_total_tokens": 100_000, "compaction": compaction},
        wait=True,
        timeout=timeout,
    )
    assert isinstance(trajectory, Trajectory)
    assert trajectory.status is JobStatus.completed, trajectory.error
    return trajectory


def total_ids(trajectory: Trajectory) -> int:
    """Ids over every segment: prompts and what followed them."""
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in sequences(trajectory))


def assert_segments_exact(
    trajectory: Trajectory, model_dir: Path, context: int, tolerance: float
) -> int:
    """Every segment fits `context` and its ids are one sequence the model scored: the
    logprobs recorded on its generated ids equal a float32 teacher-forced recomputation of
    the segment's prompt and ids under `model_dir` (within `tolerance`), and its other ids
    carry none. Returns how many segments there are."""
    parts = sequences(trajectory)
    for k, segment in enumerate(parts):
        total = len(segment.prompt_ids) + len(segment.response_ids)
        assert total <= context, f"segment {k} holds {total} ids, past the context of {context}"
        generated = [i for i, mask in enumerate(segment.loss_mask) if mask == 1]
        assert all(
            (lp is None) == (mask == 0)
            for lp, mask in zip(segment.logprobs, segment.loss_mask, strict=True)
        )
        recomputed = teacher_forced(model_dir, segment.prompt_ids, segment.response_ids)
        recorded = [segment.logprobs[i] for i in generated]
        assert (
            generated
            and max_diff(
                [float(lp) for lp in recorded if lp is not None], [recomputed[i] for i in generated]
            )
            < tolerance
        ), f"segment {k}'s logprobs are not its model's"
    return len(parts)
