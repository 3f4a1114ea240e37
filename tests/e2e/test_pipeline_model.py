"""Token fidelity end to end: a real stack whose backend runs the tiny Qwen3 with transformers.

The logprobs a trajectory carries were computed by the backend while generating; recomputing
them in one teacher-forced pass over the final sequence gives the same numbers only if every
turn was generated on exactly the ids that precede it in the trajectory — that is, the ids sent
on turn k+1 began with exactly the ids of turn k, and nothing was re-tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import EnvTurn, JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack

pytestmark = pytest.mark.full

TASK = {"data_source": "math", "instance_id": "sum", "problem": "What is 2+3?", "answer": "5"}


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"workers": {"init": 1, "run": 1, "eval": 1}}


@pytest.fixture(scope="module")
def trajectory(stack: Stack) -> Trajectory:
    with RolloutClient(stack.gateway_url, timeout=120) as client:
        traj = client.submit_rollout(
            TASK,
            sampling={"temperature": 1.0, "max_tokens": 12, "seed": 7},
            agent={"max_turns": 3},
            wait=True,
            timeout=120,
        )
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed, traj.error
    return traj


def test_random_model_runs_every_turn_with_reminders_between(trajectory: Trajectory) -> None:
    # The random model never gives a boxed answer, so the handler reminds it until max_turns.
    assert [t.type for t in trajectory.turns] == ["model", "env", "model", "env", "model"]
    assert trajectory.stop_reason == "max_turns"
    assert trajectory.reward == 0.0


def test_each_turn_prompt_is_exactly_the_ids_appended_since_the_last(
    trajectory: Trajectory,
) -> None:
    turns = trajectory.turns
    sequence: list[int] = []
    for index, turn in enumerate(turns):
        if isinstance(turn, ModelTurn):
            sequence += turn.prompt_ids
            if index > 0:
                previous = turns[index - 1]
                assert isinstance(previous, EnvTurn)
                assert turn.prompt_ids == previous.observation_ids
            sequence += turn.output_ids
    assert sequence == trajectory.prompt_ids + trajectory.response_ids


def test_observations_are_whole_chat_turns_masked_out(
    trajectory: Trajectory, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for turn in trajectory.turns:
        if isinstance(turn, EnvTurn):
            text = tokenizer.decode(turn.observation_ids)
            assert "<|im_start|>user\n" in text
            assert text.endswith("<|im_start|>assistant\n")
    generated = sum(len(t.output_ids) for t in trajectory.turns if isinstance(t, ModelTurn))
    assert sum(trajectory.loss_mask) == generated


def test_logprobs_equal_a_teacher_forced_recomputation(
    trajectory: Trajectory, tiny_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = trajectory.prompt_ids + trajectory.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    # The backend samples over the ids the tokenizer defines (the output layer is padded).
    logits[:, len(AutoTokenizer.from_pretrained(tiny_model_dir)) :] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(trajectory.prompt_ids)
    checked = 0
    for offset, (mask, returned) in enumerate(
        zip(trajectory.loss_mask, trajectory.logprobs, strict=True)
    ):
        if mask == 0:
            assert returned is None
            continue
        position = start + offset
        expected = logprobs[position - 1, ids[position]].item()
        assert returned == pytest.approx(expected, abs=1e-4), (offset, returned, expected)
        checked += 1
    assert checked == sum(trajectory.loss_mask) >= 3
