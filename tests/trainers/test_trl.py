"""`trainers.trl`: TRL's GRPOTrainer trains on the CPU with its rollouts from rollserve.

The end-to-end test runs a whole stack (embedded Redis, prefork workers, the gateway, the
development server scoring the shipped demo script with the tiny Qwen3), and a real
`trl.GRPOTrainer` on the same tiny model for two optimizer steps. It checks that what TRL trained
on is rollserve's record: prompt and completion ids, the loss mask (zeros on the reminder turns the
math handler appends), and the rewards it logged. The other tests cover the adapter's pure parts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import BatchAccepted, JobStatus, Segment, StageError, Trajectory
from deploy.stack import Stack
from tests.support.examples import read_jsonl
from tests.support.stack import start_stack
from trainers.trl import (
    ENV_MASK_KEY,
    REWARD_KEY,
    SEGMENTS_KEY,
    Group,
    RolloutFailed,
    completion_of,
    plan_groups,
    problem_text,
    prompt_text,
    rollserve_reward,
    rollserve_rollout_func,
    tasks_by_prompt,
    trl_output,
)
from trainers.trl_weights import rollserve_weight_push

pytestmark = pytest.mark.full

GROUP = 2
PAD = 151643

MATH_TASKS = [t for t in read_jsonl("demo_tasks.jsonl") if t["data_source"] == "math"]


def trajectory(**fields: Any) -> Trajectory:
    base: dict[str, Any] = {
        "job_id": "j1",
        "group_id": "g1",
        "instance_id": "t1",
        "data_source": "math",
        "status": JobStatus.completed,
        "reward": 1.0,
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 20, 21, 12],
        "loss_mask": [1, 1, 0, 0, 1],
        "logprobs": [-0.5, -0.25, None, None, -1.0],
    }
    return Trajectory.model_validate({**base, **fields})


# ----------------------------------------------------------------------------- pure parts


def test_groups_follow_trls_repeated_prompts() -> None:
    prompts = ["a"] * 4 + ["b"] * 4 + ["a"] * 4
    assert plan_groups(prompts, 4) == [Group(0, 4), Group(4, 4), Group(8, 4)]
    # The same prompt drawn twice in a row is two groups, not one of eight.
    assert plan_groups(["a"] * 8, 4) == [Group(0, 4), Group(4, 4)]
    # A process's slice that cuts a group short: the pieces keep their own sizes.
    assert plan_groups(["a", "a", "b", "b", "b", "b"], 4) == [Group(0, 2), Group(2, 4)]
    conversation = [{"role": "user", "content": "x"}]
    assert plan_groups([conversation, list(conversation)], None) == [Group(0, 2)]


def test_prompt_text_and_tasks_by_prompt() -> None:
    build = tasks_by_prompt(MATH_TASKS)
    for task in MATH_TASKS:
        text = problem_text(task)
        assert build(text) == task
        assert (
            build([{"role": "system", "content": "s"}, {"role": "user", "content": text}]) == task
        )
    blocks = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert prompt_text(blocks) == "ab"
    with pytest.raises(KeyError, match="no rollserve task"):
        build("unknown")
    twin = {**MATH_TASKS[0], "instance_id": "twin"}
    with pytest.raises(ValueError, match="two different tasks"):
        tasks_by_prompt([MATH_TASKS[0], twin])


def test_a_completed_job_is_its_record() -> None:
    out = trl_output([trajectory()], PAD)
    assert out["prompt_ids"] == [[1, 2, 3]]
    assert out["completion_ids"] == [[10, 11, 20, 21, 12]]
    assert out[ENV_MASK_KEY] == [[1, 1, 0, 0, 1]]
    assert out["logprobs"] == [[-0.5, -0.25, 0.0, 0.0, -1.0]]
    assert out[REWARD_KEY] == [1.0]
    assert out["rollserve_job_id"] == ["j1"] and out["rollserve_status"] == ["completed"]
    assert out[SEGMENTS_KEY] == [1]


def test_a_job_of_several_segments_is_its_first_segment(caplog: pytest.LogCaptureFixture) -> None:
    """TRL takes one completion per prompt: the later segments are counted, not trained."""
    later = Segment(
        reason="history_changed",
        first_turn=3,
        prompt_ids=[1, 2, 3, 30],
        response_ids=[14, 15],
        loss_mask=[1, 1],
        logprobs=[-0.5, -0.6],
    )
    with caplog.at_level(logging.WARNING):
        out = trl_output([trajectory(segments=[later]), trajectory(job_id="j2")], PAD)
    assert out["prompt_ids"] == [[1, 2, 3], [1, 2, 3]]
    assert out["completion_ids"][0] == [10, 11, 20, 21, 12]
    assert out[ENV_MASK_KEY][0] == [1, 1, 0, 0, 1]
    assert out[REWARD_KEY] == [1.0, 1.0]
    assert out[SEGMENTS_KEY] == [2, 1]
    assert "1 later segment(s) of 1 job(s) not trained" in caplog.text


def test_failed_jobs_by_policy() -> None:
    failed = trajectory(
        status=JobStatus.failed,
        reward=None,
        error=StageError(stage="run", type="backend", message="gone"),
    )
    skipped = completion_of(failed, PAD, "skip")
    assert skipped.reward is None and skipped.env_mask == [0] * 5
    assert skipped.completion_ids == failed.response_ids
    zero = completion_of(failed, PAD, "zero")
    assert zero.reward == 0.0 and zero.env_mask == failed.loss_mask
    with pytest.raises(RolloutFailed, match="ended failed: run backend: gone"):
        completion_of(failed, PAD, "raise")
    empty = trajectory(
        status=JobStatus.timed_out,
        reward=None,
        prompt_ids=[],
        response_ids=[],
        loss_mask=[],
        logprobs=[],
    )
    nothing = completion_of(empty, PAD, "skip")
    assert (nothing.prompt_ids, nothing.completion_ids, nothing.env_mask) == ([PAD], [PAD], [0])
    assert nothing.logprobs == [0.0]


def test_reward_function_needs_the_rollout_func() -> None:
    logged: dict[str, list[Any]] = {}
    rewards = rollserve_reward(
        ["x", "y"],
        rollserve_reward=[1, None],
        rollserve_job_id=["a", "b"],
        log_extra=lambda column, values: logged.__setitem__(column, values),
    )
    assert rewards == [1.0, None]
    assert logged == {"rollserve_job_id": ["a", "b"]}
    with pytest.raises(ValueError, match="rollserve_rollout_func"):
        rollserve_reward(["x"], trainer_state=None)


class FakeClient:
    """Answers batches with trajectories in reverse order; records what was asked."""

    def __init__(self, fail_results: bool = False) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.fail_results = fail_results
        self.jobs: dict[str, list[Trajectory]] = {}

    def submit_batch(self, tasks: list[dict[str, Any]], **kwargs: Any) -> BatchAccepted:
        batch = f"b{len(self.submitted)}"
        self.submitted.append({"tasks": tasks, **kwargs})
        size = kwargs["group_size"]
        made = [
            trajectory(
                job_id=f"{batch}-{t}-{i}",
                batch_id=batch,
                instance_id=task["instance_id"],
                sample_index=i,
                reward=float(i),
            )
            for t, task in enumerate(tasks)
            for i in range(size)
        ]
        self.jobs[batch] = made
        return BatchAccepted(batch_id=batch, jobs=[m.job_id for m in made])

    def iter_batch_results(self, batch_id: str) -> Iterator[Trajectory]:
        if self.fail_results:
            raise RuntimeError("stream broke")
        yield from reversed(self.jobs[batch_id])

    def cancel_batch(self, batch_id: str) -> None:
        self.cancelled.append(batch_id)


class FakeTrainer:
    num_generations = 2
    processing_class = SimpleNamespace(pad_token_id=PAD)


def test_rollouts_keep_trls_order_and_move_the_seed_on() -> None:
    fake = FakeClient()
    tasks = [{"data_source": "math", "instance_id": n, "problem": n} for n in ("a", "b", "c")]
    rollout = rollserve_rollout_func(
        fake,  # type: ignore[arg-type]
        tasks_by_prompt(tasks),
        sampling={"seed": 7, "temperature": 0.5},
    )
    # Groups of 2, and one cut short (a process's slice): two batches, sizes 2 and 1.
    out = rollout(["a", "a", "b", "b", "c"], FakeTrainer())
    assert [b["group_size"] for b in fake.submitted] == [2, 1]
    assert [b["sampling"] for b in fake.submitted] == [
        {"seed": 7, "temperature": 0.5},
        {"seed": 9, "temperature": 0.5},
    ]
    assert [t.instance_id for t in rollout.last] == ["a", "a", "b", "b", "c"]
    assert [t.sample_index for t in rollout.last] == [0, 1, 0, 1, 0]
    assert out[REWARD_KEY] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert out["rollserve_job_id"] == ["b0-0-0", "b0-0-1", "b0-1-0", "b0-1-1", "b1-0-0"]
    rollout(["a", "a"], FakeTrainer())
    assert fake.submitted[-1]["sampling"]["seed"] == 10


def test_an_interrupted_rollout_cancels_its_batches() -> None:
    fake = FakeClient(fail_results=True)
    tasks = [{"data_source": "math", "instance_id": "a", "problem": "a"}]
    rollout = rollserve_rollout_func(fake, tasks_by_prompt(tasks))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="stream broke"):
        rollout(["a", "a"], FakeTrainer())
    assert fake.cancelled == ["b0"]


def test_a_bad_failure_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on_failure"):
        rollserve_rollout_func("http://127.0.0.1:9", tasks_by_prompt([]), on_failure="ignore")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- for real


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """The development server answers the demo script (sample `seed % 4` of a task's entry;
    sample 2 in two turns around the math handler's reminder), its logprobs scored by the tiny
    model."""
    data = tmp_path_factory.mktemp("trl-stack")
    running = start_stack(data, tiny_model_dir, script=read_jsonl("demo_script.jsonl"))
    yield running
    running.stop()


def test_grpo_trainer_trains_two_steps_on_rollserve_rollouts(
    stack: Stack, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    seen: list[dict[str, Any]] = []

    class RecordingTrainer(GRPOTrainer):  # type: ignore[misc]
        """Keeps the tensors each generation hands to the loss."""

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
            seen.append({k: out[k].clone() for k in keep if k in out})
            seen[-1]["prompts"] = [x["prompt"] for x in inputs]
            return out

    batches: list[list[Trajectory]] = []
    build = tasks_by_prompt(MATH_TASKS)
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        rollout = rollserve_rollout_func(
            client, build, sampling={"seed": 0, "max_tokens": 128}, on_batch=batches.append
        )
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            max_steps=2,
            per_device_train_batch_size=GROUP,
            gradient_accumulation_steps=2,  # one generation of 2 prompts x 2 per optimizer step
            num_generations=GROUP,
            learning_rate=1e-4,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        # The trainer pushes its weights itself: version 0 at the start, then each step's.
        push = rollserve_weight_push(client, tmp_path / "weights", keep=2)
        trainer = RecordingTrainer(
            model=str(tiny_model_dir),
            reward_funcs=rollserve_reward,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": problem_text(t)} for t in MATH_TASKS]),
            rollout_func=rollout,
            callbacks=[push],
        )
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()

    # Two optimizer steps, each on one rollserve batch of two groups of two: seeds 0-1, then
    # 2-3 (the adapter moves the seed on), so the second step has the two-turn samples.
    assert trainer.state.global_step == 2
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert len(batches) == 2 and len(seen) == 2
    assert all(len(batch) == 2 * GROUP for batch in batches)
    changed = any(
        not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)
    )
    assert changed, "the optimizer steps did not move the weights"

    # Each batch was generated by the weights pushed before it, and says so; the fleet holds
    # the last step's checkpoint, and only the two newest are kept on disk.
    weights = tmp_path / "weights"
    assert [v for v, _ in push.pushed] == [0, 1, 2]
    assert [{t.policy_version for t in batch} for batch in batches] == [{0}, {1}]
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        [backend] = client.list_backends()
    assert (backend.policy_version, backend.weights_path) == (2, str(weights / "step-2"))
    assert sorted(p.name for p in weights.iterdir()) == ["step-1", "step-2"]

    env_zeros = 0
    for batch, got in zip(batches, seen, strict=True):
        assert {t.batch_id for t in batch} != {None} and len({t.batch_id for t in batch}) == 1
        for row, traj in enumerate(batch):
            # TRL's order: row r is sample r % GROUP of the task of the prompt TRL put there.
            assert traj.status == JobStatus.completed, traj.error
            assert traj.instance_id == build(got["prompts"][row])["instance_id"]
            assert traj.sample_index == row % GROUP
            n = len(traj.response_ids)
            prompt = got["prompt_ids"][row][got["prompt_mask"][row].bool()].tolist()
            assert prompt == traj.prompt_ids
            assert got["completion_ids"][row][:n].tolist() == traj.response_ids
            assert got["completion_mask"][row].sum().item() == n
            assert got["tool_mask"][row][:n].tolist() == traj.loss_mask
            trained = (got["completion_mask"][row] * got["tool_mask"][row])[:n].tolist()
            assert trained == traj.loss_mask
            assert all(t == 0 for t, m in zip(trained, traj.loss_mask, strict=True) if m == 0)
            # Zeros inside the completion: the observation turn between two model turns.
            last_one = max(i for i, m in enumerate(traj.loss_mask) if m)
            env_zeros += traj.loss_mask[:last_one].count(0)
    assert env_zeros > 0, "no trajectory had an environment turn between two model turns"

    # The rewards TRL logged are rollserve's, in the same order.
    for entry, batch in zip(steps, batches, strict=True):
        rewards = [t.reward for t in batch]
        assert all(r is not None for r in rewards)
        mean = sum(r for r in rewards if r is not None) / len(rewards)
        assert math.isclose(entry[f"rewards/{REWARD_KEY}/mean"], mean, abs_tol=1e-6)
        assert math.isclose(entry["reward"], mean, abs_tol=1e-6)
    last = batches[-1]
    assert list(trainer._logs["rewards"][REWARD_KEY]) == [t.reward for t in last]
    assert list(trainer._logs["extra"]["rollserve_job_id"]) == [t.job_id for t in last]
    tokenizer = trainer.processing_class
    decoded = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in last]
    assert list(trainer._logs["completion"]) == decoded
    assert any(
        len({t.reward for t in b[i : i + GROUP]}) > 1 for b in batches for i in (0, GROUP)
    ), "no informative group: the test would not exercise the advantages"
