"""The default stack works end to end: `rollserve up` with the development server and the tiny
model (no script) completes multi-turn math jobs over REST, and no sampled id lies past the
tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus, ModelTurn, Trajectory
from tests.support.stack import ROOMY_LIMITS

pytestmark = pytest.mark.full

if TYPE_CHECKING:
    from deploy.stack import Stack

REPO = Path(__file__).resolve().parents[2]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    # As `rollserve up` starts it: the development server with the tiny model, no script.
    return {"script": None, "workers": {"init": 1, "run": 2, "eval": 1}, **ROOMY_LIMITS}


def test_multi_turn_math_over_rest_completes_every_job(stack: Stack, tiny_tokenizer: Any) -> None:
    tasks = [
        json.loads(line)
        for line in (REPO / "examples" / "math_tasks.jsonl").read_text().splitlines()
        if line.strip()
    ]
    with RolloutClient(stack.gateway_url, timeout=120) as client:
        # No seed: a fixed one repeats much the same draws for every prompt of a near-uniform
        # random model. Unseeded, the ~2,000 ids sampled here would almost surely include some
        # of the padded ids (0.18 % of the model's distribution) if they were not masked.
        accepted = client.submit_batch(
            tasks,
            group_size=2,
            sampling={"temperature": 1.0, "max_tokens": 32},
            agent={"max_turns": 3},
        )
        results: list[Trajectory] = list(client.iter_batch_results(accepted.batch_id))
    assert len(results) == 2 * len(tasks)
    failed = [(t.job_id, t.status, t.error) for t in results if t.status is not JobStatus.completed]
    assert not failed
    generated = 0
    model_turns = []
    for trajectory in results:
        assert trajectory.reward is not None
        assert trajectory.stop_reason in ("answer", "max_turns"), trajectory.stop_reason
        model_turns.append(len([t for t in trajectory.turns if isinstance(t, ModelTurn)]))
        ids = trajectory.prompt_ids + trajectory.response_ids
        assert max(ids) < len(tiny_tokenizer)
        generated += sum(trajectory.loss_mask)
    assert min(model_turns) >= 1 and max(model_turns) >= 2  # multi-turn: prompts carried ids back
    assert generated >= 10 * len(results)
