"""The training example (`examples/train`): its task family reaches the workers as a handler
plugin through the `rollserve.handlers` entry point, and its GRPO trainer runs through a real
stack — rollouts and rewards from the service, each step's weights loaded into the development
server it rolls out on, policy versions moving on turn by turn, one step off-policy in async
mode. Whether it *learns* is `bench/train.py`'s question (minutes, not a unit test's)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient, RolloutServiceError
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.stack import start_stack
from workers.handlers.base import TaskValidationError
from workers.handlers.registry import ENTRY_POINT_GROUP, get_handler

casing = pytest.importorskip(
    "rollserve_casing",
    reason="the example is not installed (make install: pip install -e examples/train)",
)
from rollserve_casing.grpo import Config, StepStats, train  # noqa: E402
from rollserve_casing.handler import CasingHandler, score  # noqa: E402
from rollserve_casing.policy import WarmStart, make_policy, token_logprobs  # noqa: E402

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A warm start of a few steps: enough to write words, quick to make."""
    out = tmp_path_factory.mktemp("casing") / "start"
    return make_policy(tiny_model_dir, out, WarmStart(steps=8))


@pytest.fixture(scope="module")
def casing_stack(tmp_path_factory: pytest.TempPathFactory, policy: Path) -> Iterator[Stack]:
    stack = start_stack(
        tmp_path_factory.mktemp("stack"), policy, workers={"init": 1, "run": 2, "eval": 1}
    )
    yield stack
    stack.stop()


# ----------------------------------------------------------------------------- the plugin


def test_the_task_family_is_a_plugin_found_through_its_entry_point() -> None:
    found = {e.name: e.value for e in entry_points(group=ENTRY_POINT_GROUP)}
    assert found["casing"] == "rollserve_casing.handler:CasingHandler"
    assert isinstance(get_handler("casing"), CasingHandler)


@pytest.mark.parametrize(
    ("text", "words", "case", "reward"),
    [
        ("apple river stone", 3, "lower", 1.0),
        ("apple River stone", 3, "lower", 2 / 3),
        ("apple river", 4, "lower", 0.5),  # fewer words than asked do not help
        ("a b c d e f", 3, "lower", 1.0),
        ("a b C D E F", 3, "lower", 2 / 6),  # nor do more
        ("<|im_start|>apple<|im_end|>", 1, "lower", 1.0),  # control tokens are not words
        ("APPLE River", 2, "upper", 0.5),
        ("Apple River", 2, "title", 1.0),
        ("", 3, "lower", 0.0),
    ],
)
def test_the_reward_is_the_share_of_words_in_the_asked_case(
    text: str, words: int, case: str, reward: float
) -> None:
    assert score(text, words, case)[0] == pytest.approx(reward)


@pytest.mark.parametrize(
    ("task", "field"),
    [
        ({"words": 0}, "words"),
        ({"words": "5"}, "words"),
        ({"words": True}, "words"),
        ({"case": "snake"}, "case"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_malformed_task_is_refused_naming_its_field(task: dict[str, Any], field: str) -> None:
    with pytest.raises(TaskValidationError) as refused:
        CasingHandler().validate({"data_source": "casing", **task})
    assert refused.value.field == field


def test_the_gateway_refuses_a_malformed_casing_task_at_submission(casing_stack: Stack) -> None:
    with RolloutClient(casing_stack.gateway_url) as client:
        before = client.stats()
        with pytest.raises(RolloutServiceError) as refused:
            client.submit_batch([{"data_source": "casing", "words": 99}], group_size=2)
        assert refused.value.status_code == 422
        assert "words" in str(refused.value)
        assert client.stats() == before  # nothing enqueued


# ----------------------------------------------------------------------------- the trainer


def logprobs_under(policy: Path, traj: Trajectory) -> list[float]:
    """The response tokens' logprobs under the weights in `policy` (transformers, float32)."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        logp, _ = token_logprobs(model, [(traj.prompt_ids, traj.response_ids)], pad=151643)
    return [float(x) for x in logp[0]]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_trainer_rolls_out_trains_and_switches_the_fleet(
    casing_stack: Stack, policy: Path, tmp_path: Path, mode: str
) -> None:
    cfg = Config(
        url=casing_stack.gateway_url,
        policy_dir=policy,
        work_dir=tmp_path / "weights",
        steps=3,
        prompts=2,
        group_size=4,
        max_tokens=8,
        mode=mode,
        max_staleness=1,
    )
    batches: dict[int, list[Trajectory]] = {}
    seen: list[StepStats] = []
    stats = train(cfg, seen.append, lambda step, trajs: batches.__setitem__(step, trajs))
    assert [s.step for s in stats] == [0, 1, 2] and seen == stats

    handler = CasingHandler()
    for step, trajectories in batches.items():
        assert len(trajectories) == cfg.prompts * cfg.group_size
        assert all(t.status is JobStatus.completed for t in trajectories)
        for traj in trajectories:
            # The reward is rollserve's EVAL, the plugin's grade of what the model wrote.
            text = "".join(t.text for t in traj.turns if t.type == "model")
            task = {"words": traj.eval["asked"], "case": "lower"}
            assert traj.reward == pytest.approx(handler.grade(task, [text], job_id="x").reward)
            versions = {t.policy_version for t in traj.turns if t.type == "model"}
            if mode == "sync":
                # Rolled out after step's weights were loaded, before the next.
                assert versions == {step}
            else:
                # Submitted before the previous step trained: its weights or the next.
                assert versions <= {max(0, step - 1), step}
    if mode == "sync":
        assert all(s.staleness == {0: cfg.prompts * cfg.group_size} for s in stats)
        # On-policy: the served logprobs are the trainer's own (the weights did load).
        assert max(s.max_ratio_deviation for s in stats) < 1e-3
    else:
        assert all(set(s.staleness) <= {0, 1} for s in stats), [s.staleness for s in stats]

    with RolloutClient(casing_stack.gateway_url) as client:
        (backend,) = client.list_backends()
    assert backend.policy_version == cfg.steps and backend.state == "healthy"
    # The last batch was generated by trained weights, not the starting ones: the logprobs the
    # server returned for it are not the starting policy's.
    last = batches[cfg.steps - 1][0]
    start = logprobs_under(policy, last)
    assert max(abs(a - (b or 0.0)) for a, b in zip(start, last.logprobs, strict=True)) > 1e-3
