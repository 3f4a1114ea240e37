"""Context compaction end to end on the development server sampling from the tiny model: math
episodes whose ids add up to several times the server's context complete, each compaction a
summary the policy wrote and a new segment, every segment within the context and scored by
the model itself (its logprobs equal a float32 recomputation of the segment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import ModelTurn
from tests.support.segments import assert_segments_exact, compacted_episode, total_ids

pytestmark = [pytest.mark.full, pytest.mark.compaction]

CONTEXT = 512
"""The development server's `--max-model-len`."""
TASK = {"data_source": "math", "instance_id": "long", "problem": "What is 2+2?", "answer": "4"}


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "workers": {"init": 1, "run": 1, "eval": 1},
        "dev_args": ["--max-model-len", str(CONTEXT)],
        "run_soft_time_limit": 240.0,
        "run_time_limit": 250.0,
        "visibility_timeout": 300.0,
    }


def test_episodes_several_contexts_long_compact_into_exact_segments(
    client: RolloutClient, tiny_model_dir: Path
) -> None:
    # The random tiny model never states an answer: each turn is 64 sampled ids and a reminder,
    # and the episode runs all its 12 turns, compacting whenever it passes 300 ids.
    compaction = {"threshold": 300, "keep_turns": 1, "max_summary_tokens": 48}
    traj = compacted_episode(
        client, TASK, compaction, seed=7, max_tokens=64, max_turns=12, timeout=600
    )
    assert traj.stop_reason == "max_turns"
    reasons = [s.reason for s in traj.segments]
    assert len(reasons) >= 3 and set(reasons) == {"compaction"}
    total = total_ids(traj)
    assert total > 3 * CONTEXT
    # Each compaction's summary was generated (trained on), at most 48 ids, right before the
    # call that began the segment.
    for segment in traj.segments:
        summary = traj.turns[segment.first_turn - 1]
        assert isinstance(summary, ModelTurn) and 0 < len(summary.output_ids) <= 48
    count = assert_segments_exact(traj, tiny_model_dir, CONTEXT, tolerance=1e-3)
    assert count == len(traj.segments) + 1
    print(f"\n{count} segments, {total} ids in all, context {CONTEXT}")
