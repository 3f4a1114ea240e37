"""The veRL adapter (`trainers.verl`): rollserve trajectories → veRL's `AgentLoopOutput`.

The conversion tests run everywhere, against veRL's field names as read from its source
(verl-project/verl 1dda039, `verl/experimental/agent_loop/agent_loop.py`; the same in the
released `verl==0.9.1`). The end-to-end tests run `RollserveAgentLoop.run` against a whole
stack (embedded Redis, prefork workers, the gateway, the development server playing scripted
answers). Without veRL in this environment the class stands on `StandaloneAgentLoopBase`; the
last test runs it over veRL's real `AgentLoopBase`, instantiated the way `AgentLoopWorker`
does and post-processed by veRL's own `_agent_loop_postprocess` and `_postprocess`, in a
Python where veRL imports (`ROLLSERVE_VERL_PYTHON`), and skips with the reason otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.schemas import EnvTurn, JobStatus, ModelTurn, Segment, StageError, Timing, Trajectory
from deploy.stack import Stack
from tests.support.stack import start_stack
from trainers import verl as adapter
from trainers.verl import (
    AGENT_LOOP_METRICS_FIELDS,
    AGENT_LOOP_OUTPUT_FIELDS,
    AGENT_NAME,
    StandaloneAgentLoopOutput,
    agent_from_verl,
    agent_loop_fields,
    agent_loop_outputs,
    sampling_from_verl,
    task_from_row,
)

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]

VERL_AGENT_LOOP_OUTPUT = {
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "routed_experts",
    "multi_modal_data",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
    "mm_processor_kwargs",
}
"""`AgentLoopOutput`'s fields at verl-project/verl 1dda039 (0.9.1 adds `mm_processor_output`)."""

VERL_AGENT_LOOP_METRICS = {"generate_sequences", "tool_calls", "compute_score", "num_preempted"}

VERL_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "repetition_penalty": 1.0,
    "logprobs": True,
}
"""What `AgentLoopWorker.generate_sequences` passes to `run` (with `calculate_log_probs`)."""


def trajectory(**overrides: Any) -> Trajectory:
    """A finished two-call episode: prompt [1, 2, 3]; the model says [10, 11], the environment
    answers [20, 21, 22], the model says [12, 13]."""
    fields: dict[str, Any] = {
        "job_id": "job-1",
        "group_id": "group-1",
        "instance_id": "gsm8k-7",
        "data_source": "math",
        "status": JobStatus.completed,
        "reward": 1.0,
        "stop_reason": "answer",
        "timing": Timing(queue=0.1, init=0.2, run=1.5, eval=0.25, llm=1.0, tools=0.3),
        "turns": [
            ModelTurn(
                prompt_ids=[1, 2, 3],
                output_ids=[10, 11],
                logprobs=[-0.1, -0.2],
                finish_reason="stop",
                text="a",
                policy_version=3,
            ),
            EnvTurn(observation_ids=[20, 21, 22], text="obs"),
            ModelTurn(
                prompt_ids=[20, 21, 22],
                output_ids=[12, 13],
                logprobs=[-0.3, -0.4],
                finish_reason="stop",
                text="b",
                policy_version=4,
            ),
        ],
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 20, 21, 22, 12, 13],
        "loss_mask": [1, 1, 0, 0, 0, 1, 1],
        "logprobs": [-0.1, -0.2, None, None, None, -0.3, -0.4],
    }
    fields.update(overrides)
    return Trajectory(**fields)


def two_segments(**overrides: Any) -> Trajectory:
    """`trajectory()`, then a harness that edited its history: the next call's prompt is
    [1, 2, 3, 30, 31] (a new segment); the model says [14, 15], the environment [23], the
    model [16]."""
    base = trajectory()
    later = [
        ModelTurn(
            prompt_ids=[1, 2, 3, 30, 31],
            output_ids=[14, 15],
            logprobs=[-0.5, -0.6],
            finish_reason="stop",
            text="c",
            policy_version=4,
            segment_start="history_changed",
        ),
        EnvTurn(observation_ids=[23], text="obs 2"),
        ModelTurn(
            prompt_ids=[23],
            output_ids=[16],
            logprobs=[-0.7],
            finish_reason="stop",
            text="d",
            policy_version=5,
        ),
    ]
    segment = Segment(
        reason="history_changed",
        first_turn=3,
        prompt_ids=[1, 2, 3, 30, 31],
        response_ids=[14, 15, 23, 16],
        loss_mask=[1, 1, 0, 1],
        logprobs=[-0.5, -0.6, None, -0.7],
        policy_versions=[4, 5],
    )
    return trajectory(**{"turns": [*base.turns, *later], "segments": [segment], **overrides})


# ----------------------------------------------------------------------------- field names


def test_the_fields_filled_are_verl_agent_loop_output_fields() -> None:
    assert set(AGENT_LOOP_OUTPUT_FIELDS) <= VERL_AGENT_LOOP_OUTPUT
    assert set(AGENT_LOOP_METRICS_FIELDS) == VERL_AGENT_LOOP_METRICS
    assert set(agent_loop_fields(trajectory())) == set(AGENT_LOOP_OUTPUT_FIELDS)
    assert set(StandaloneAgentLoopOutput.model_fields) == set(AGENT_LOOP_OUTPUT_FIELDS)
    assert AGENT_NAME == "rollserve_agent"


def test_the_fields_match_the_installed_verl_when_there_is_one() -> None:
    module = pytest.importorskip(
        "verl.experimental.agent_loop.agent_loop", reason="veRL is not installed here"
    )
    assert set(AGENT_LOOP_OUTPUT_FIELDS) <= set(module.AgentLoopOutput.model_fields)
    assert set(AGENT_LOOP_METRICS_FIELDS) == set(module.AgentLoopMetrics.model_fields)
    output = module.AgentLoopOutput(**agent_loop_fields(trajectory()))
    assert output.response_mask == [1, 1, 0, 0, 0, 1, 1]


# ----------------------------------------------------------------------------- conversion


def test_a_trajectory_becomes_agent_loop_output_fields() -> None:
    fields = agent_loop_fields(trajectory())
    assert fields["prompt_ids"] == [1, 2, 3]
    assert fields["response_ids"] == [10, 11, 20, 21, 22, 12, 13]
    assert fields["response_mask"] == [1, 1, 0, 0, 0, 1, 1]
    assert fields["response_logprobs"] == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert fields["reward_score"] == 1.0
    assert fields["num_turns"] == 4  # veRL's tool loop: user turns + assistant turns + 1
    assert fields["metrics"] == {
        "generate_sequences": 1.0,
        "tool_calls": 0.3,
        "compute_score": 0.25,
        "num_preempted": -1,
    }
    extra = fields["extra_fields"]
    assert extra["turn_scores"] == [] and extra["tool_rewards"] == []
    assert extra["rollserve_job_id"] == "job-1"
    assert extra["rollserve_status"] == "completed"
    assert extra["rollserve_stop_reason"] == "answer"
    assert extra["rollserve_truncated"] is False
    assert extra["rollserve_policy_versions"] == [3, 4]
    assert extra["rollserve_error"] is None


def test_the_response_is_cut_to_verls_response_length() -> None:
    fields = agent_loop_fields(trajectory(), response_length=4)
    assert fields["response_ids"] == [10, 11, 20, 21]
    assert fields["response_mask"] == [1, 1, 0, 0]
    assert fields["response_logprobs"] == [-0.1, -0.2, 0.0, 0.0]
    assert fields["extra_fields"]["rollserve_truncated"] is True
    uncut = agent_loop_fields(trajectory(), response_length=7)
    assert uncut["response_ids"] == trajectory().response_ids
    assert uncut["extra_fields"]["rollserve_truncated"] is False


def test_a_long_prompt_keeps_its_last_ids_as_verl_does(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        fields = agent_loop_fields(trajectory(), prompt_length=2)
    assert fields["prompt_ids"] == [2, 3]
    assert "prompt_length=2" in caplog.text


def test_logprobs_are_left_out_when_verl_did_not_ask_for_them() -> None:
    assert agent_loop_fields(trajectory(), with_logprobs=False)["response_logprobs"] is None


def test_a_job_that_did_not_complete_is_masked_with_reward_zero() -> None:
    error = StageError(stage="run", type="BackendError", message="backend down")
    failed = trajectory(status=JobStatus.failed, reward=None, error=error)
    fields = agent_loop_fields(failed)
    assert fields["response_mask"] == [0] * 7
    assert fields["response_ids"] == trajectory().response_ids
    assert fields["reward_score"] == 0.0
    assert fields["extra_fields"]["rollserve_status"] == "failed"
    assert fields["extra_fields"]["rollserve_error"]["type"] == "BackendError"
    empty = trajectory(
        status=JobStatus.timed_out, reward=None, turns=[], prompt_ids=[], response_ids=[],
        loss_mask=[], logprobs=[],
    )  # fmt: skip
    fields = agent_loop_fields(empty)
    assert fields["prompt_ids"] == [] and fields["response_ids"] == []
    assert fields["num_turns"] == 1


def test_each_segment_is_an_output_of_its_own_with_the_jobs_reward() -> None:
    first, second = agent_loop_outputs(two_segments())
    assert first["prompt_ids"] == [1, 2, 3]
    assert first["response_ids"] == [10, 11, 20, 21, 22, 12, 13]
    assert first["response_mask"] == [1, 1, 0, 0, 0, 1, 1]
    assert second["prompt_ids"] == [1, 2, 3, 30, 31]
    assert second["response_ids"] == [14, 15, 23, 16]
    assert second["response_mask"] == [1, 1, 0, 1]
    assert second["response_logprobs"] == [-0.5, -0.6, 0.0, -0.7]
    assert first["reward_score"] == second["reward_score"] == 1.0
    assert (first["num_turns"], second["num_turns"]) == (4, 4)  # each counts its own turns
    extras = [first["extra_fields"], second["extra_fields"]]
    assert [e["rollserve_segment"] for e in extras] == [0, 1]
    assert [e["rollserve_segments"] for e in extras] == [2, 2]
    assert [e["rollserve_segment_reason"] for e in extras] == ["start", "history_changed"]
    assert [e["rollserve_policy_versions"] for e in extras] == [[3, 4], [4, 5]]
    # veRL's V1 worker copies the last output's reward_extra_info to the others
    assert all(e["reward_extra_info"] == {} for e in extras)


def test_a_one_segment_trajectory_is_one_output_as_before() -> None:
    (only,) = agent_loop_outputs(trajectory())
    assert only == agent_loop_fields(trajectory())
    assert not {"rollserve_segment", "reward_extra_info"} & set(only["extra_fields"])


def test_a_job_that_did_not_complete_masks_every_segment() -> None:
    outputs = agent_loop_outputs(two_segments(status=JobStatus.failed, reward=None))
    assert [o["response_mask"] for o in outputs] == [[0] * 7, [0] * 4]
    assert [o["reward_score"] for o in outputs] == [0.0, 0.0]


def test_a_cut_episode_marks_its_last_segment_truncated() -> None:
    outputs = agent_loop_outputs(two_segments(truncated=True))
    assert [o["extra_fields"]["rollserve_truncated"] for o in outputs] == [False, True]


def test_a_misaligned_trajectory_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        agent_loop_fields(trajectory(loss_mask=[1, 1]))
    with pytest.raises(ValueError, match="logprobs"):
        agent_loop_fields(trajectory(logprobs=[-0.1]))


# ----------------------------------------------------------------------------- rows and parameters


def gsm8k_row(**overrides: Any) -> dict[str, Any]:
    """A row as veRL's `examples/data_preprocess/gsm8k.py` writes it and `RLHFDataset` hands
    it to the agent loop (numpy values where the batch keeps them)."""
    np = pytest.importorskip("numpy")
    row: dict[str, Any] = {
        "data_source": "openai/gsm8k",
        "raw_prompt": np.array(
            [{"role": "user", "content": "Natalia sold 48 clips... How many? Let's think."}],
            dtype=object,
        ),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": np.int64(7), "answer": "...#### 72"},
        "index": np.int64(7),
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "agent_name": AGENT_NAME,
    }
    row.update(overrides)
    return row


def test_a_verl_math_row_becomes_a_rollserve_task() -> None:
    task = task_from_row(gsm8k_row(), {"openai/gsm8k": "math"})
    assert task == {
        "data_source": "math",
        "question": "Natalia sold 48 clips... How many? Let's think.",
        "answer": "72",
        "instance_id": "7",
    }
    json.dumps(task)  # plain JSON: no numpy left
    assert task_from_row(gsm8k_row())["data_source"] == "openai/gsm8k"


def test_a_rows_own_rollserve_task_is_used_as_it_is() -> None:
    explicit = {"data_source": "shell", "instance_id": "t1", "instruction": "ls", "check": "true"}
    assert task_from_row(gsm8k_row(rollserve_task=explicit)) == explicit
    nested = gsm8k_row(extra_info={"index": 1, "rollserve_task": explicit})
    assert task_from_row(nested) == explicit
    with pytest.raises(ValueError, match="data_source"):
        task_from_row(gsm8k_row(rollserve_task={"instruction": "ls"}))


def test_a_row_without_a_task_or_ground_truth_is_refused() -> None:
    with pytest.raises(ValueError, match="data_source"):
        task_from_row({"raw_prompt": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError, match="ground truth"):
        task_from_row(gsm8k_row(reward_model={}))
    with pytest.raises(ValueError, match="user message"):
        task_from_row(gsm8k_row(raw_prompt=[{"role": "system", "content": "x"}]))


def test_verl_sampling_params_become_rollserve_sampling(caplog: pytest.LogCaptureFixture) -> None:
    assert sampling_from_verl(VERL_SAMPLING, response_length=512) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 512,
    }
    greedy = {**VERL_SAMPLING, "temperature": 0, "top_p": 1.0}
    assert sampling_from_verl(greedy)["temperature"] == 0.0
    with caplog.at_level(logging.WARNING):
        sampling_from_verl({**VERL_SAMPLING, "top_k": 20, "repetition_penalty": 1.1})
    assert "top_k=20" in caplog.text and "repetition penalty" in caplog.text
    assert agent_from_verl(512, 3) == {"max_total_tokens": 512, "max_turns": 3}
    assert agent_from_verl(None, None) == {}


def test_without_verl_the_class_stands_on_the_standalone_base() -> None:
    if adapter.verl_available():
        pytest.skip("veRL is installed here: RollserveAgentLoop subclasses its AgentLoopBase")
    cls = adapter.RollserveAgentLoop
    assert issubclass(cls, adapter.StandaloneAgentLoopBase)
    assert cls.__module__ == "trainers.verl" and cls.__qualname__ == "RollserveAgentLoop"
    assert adapter.output_class() is StandaloneAgentLoopOutput
    with pytest.raises(ValueError, match="on_failure"):
        cls(on_failure="ignore")


def loop_returning(found: Trajectory, trainer: dict[str, Any]) -> Any:
    """A standalone agent loop whose rollouts all end as `found`, under the `trainer` config."""
    if adapter.verl_available():
        pytest.skip("veRL is installed here: see test_the_agent_loop_runs_over_verls_own_base")
    rollout = {"prompt_length": 512, "response_length": 256, "multi_turn": {}}
    config = SimpleNamespace(config={"actor_rollout_ref": {"rollout": rollout}, "trainer": trainer})
    loop = adapter.RollserveAgentLoop(trainer_config=config, rollserve_url="http://127.0.0.1:9")

    async def run_trajectory(sampling_params: Any, **kwargs: Any) -> Trajectory:
        return found

    loop.run_trajectory = run_trajectory
    return loop


async def test_verls_v1_trainer_gets_one_output_per_segment() -> None:
    outputs = await loop_returning(two_segments(), {"use_v1": True}).run(VERL_SAMPLING)
    assert [o.response_ids for o in outputs] == [[10, 11, 20, 21, 22, 12, 13], [14, 15, 23, 16]]
    assert all(isinstance(o, StandaloneAgentLoopOutput) for o in outputs)
    one = await loop_returning(trajectory(), {"use_v1": True}).run(VERL_SAMPLING)
    assert isinstance(one, StandaloneAgentLoopOutput)  # not a list of one


async def test_verls_legacy_trainer_gets_the_first_segment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        out = await loop_returning(two_segments(), {"use_v1": False}).run(VERL_SAMPLING)
    assert out.response_ids == [10, 11, 20, 21, 22, 12, 13]
    assert "only the first segment is trained" in caplog.text


# ----------------------------------------------------------------------------- end to end

SCRIPT: list[dict[str, Any]] = [
    {"match": "VERL-ADD", "samples": [["So 2+2 = \\boxed{4}."]]},
    {"match": "VERL-TWO", "samples": [["Let me think about 3 times 4 first.", "\\boxed{12}"]]},
    {"match": "VERL-WRONG", "samples": [["It is \\boxed{5}."]]},
    {"match": "VERL-GLACIAL", "samples": [["\\boxed{1}"]], "delay": 30.0},
]


def verl_row(marker: str, question: str, answer: str, index: int) -> dict[str, Any]:
    return {
        "data_source": "openai/gsm8k",
        "raw_prompt": [{"role": "user", "content": f"{marker}: {question}"}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index},
        "index": index,
        "agent_name": AGENT_NAME,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("verl-stack")
    running = start_stack(data, tiny_model_dir, script=SCRIPT)
    yield running
    running.stop()


def standalone_loop(stack: Stack, response_length: int = 256, **kwargs: Any) -> Any:
    if adapter.verl_available():
        pytest.skip("veRL is installed here: see test_the_agent_loop_runs_over_verls_own_base")
    rollout = {"prompt_length": 512, "response_length": response_length, "multi_turn": {}}
    config = SimpleNamespace(config={"actor_rollout_ref": {"rollout": rollout}})
    return adapter.RollserveAgentLoop(
        trainer_config=config,
        server_manager=None,
        tokenizer=None,
        processor=None,
        dataset_cls=None,
        data_config=SimpleNamespace(config={}),
        rollserve_url=stack.gateway_url,
        data_source_map={"openai/gsm8k": "math"},
        **kwargs,
    )


async def test_the_agent_loop_returns_a_graded_trajectory(stack: Stack) -> None:
    loop = standalone_loop(stack)
    out = await loop.run(VERL_SAMPLING, **verl_row("VERL-ADD", "What is 2+2?", "4", 0))
    assert isinstance(out, StandaloneAgentLoopOutput)
    assert out.reward_score == 1.0
    assert out.num_turns == 2  # one user turn, one assistant turn: as veRL's single turn loop
    assert out.prompt_ids and out.response_ids
    assert out.response_mask == [1] * len(out.response_ids)
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)
    assert all(lp <= 0.0 for lp in out.response_logprobs)
    assert out.extra_fields["rollserve_status"] == "completed"
    assert out.metrics["generate_sequences"] > 0.0
    wrong = await loop.run(VERL_SAMPLING, **verl_row("VERL-WRONG", "What is 2+2?", "4", 1))
    assert wrong.reward_score == 0.0


async def test_a_multi_turn_episode_keeps_observations_out_of_the_mask(stack: Stack) -> None:
    loop = standalone_loop(stack)
    out = await loop.run(VERL_SAMPLING, **verl_row("VERL-TWO", "What is 3 times 4?", "12", 2))
    assert out.reward_score == 1.0
    assert out.num_turns == 4  # assistant, reminder, assistant, + 1
    assert 0 in out.response_mask and out.response_mask[0] == 1 and out.response_mask[-1] == 1
    assert out.response_logprobs is not None
    for mask, logprob in zip(out.response_mask, out.response_logprobs, strict=True):
        assert mask == 1 or logprob == 0.0


async def test_verls_response_length_caps_the_episode(stack: Stack) -> None:
    loop = standalone_loop(stack, response_length=6)
    out = await loop.run(VERL_SAMPLING, **verl_row("VERL-TWO", "What is 3 times 4?", "12", 3))
    assert 0 < len(out.response_ids) <= 6
    assert len(out.response_mask) == len(out.response_ids)
    assert out.extra_fields["rollserve_truncated"] is True


async def test_a_job_past_its_time_is_cancelled_and_masked(stack: Stack) -> None:
    loop = standalone_loop(stack, rollserve_timeout=3.0)
    out = await loop.run(VERL_SAMPLING, **verl_row("VERL-GLACIAL", "What is 0+1?", "1", 4))
    assert out.reward_score == 0.0
    assert set(out.response_mask) <= {0}
    assert out.extra_fields["rollserve_status"] != "completed"
    raising = standalone_loop(stack, rollserve_timeout=3.0, on_failure="raise")
    with pytest.raises(RuntimeError, match="rollserve job"):
        await raising.run(VERL_SAMPLING, **verl_row("VERL-GLACIAL", "What is 0+1?", "1", 5))


# ----------------------------------------------------------------------------- over veRL's own base

VERL_SCRIPT = r"""
import asyncio, json, sys
import numpy as np
import hydra
from omegaconf import OmegaConf
from transformers import AutoTokenizer
import verl.experimental.agent_loop.agent_loop as al
from verl.utils.dataset.rl_dataset import RLHFDataset
import trainers.verl as adapter

url, model_dir = sys.argv[1], sys.argv[2]
cls = adapter.RollserveAgentLoop
entry = dict(al._agent_loop_registry[adapter.AGENT_NAME])
entry.update(rollserve_url=url, data_source_map={"openai/gsm8k": "math"})
config = OmegaConf.create({
    "actor_rollout_ref": {
        "rollout": {"prompt_length": 512, "response_length": 64, "multi_turn": {}},
        "model": {"path": model_dir},
    },
    "data": {"apply_chat_template_kwargs": {}},
})
tokenizer = AutoTokenizer.from_pretrained(model_dir)
loop = hydra.utils.instantiate(
    config=entry,
    trainer_config=al.DictConfigWrap(config=config),
    server_manager=None,
    tokenizer=tokenizer,
    processor=None,
    hf_model_type=None,
    dataset_cls=RLHFDataset,
    data_config=al.DictConfigWrap(config.data),
    tools=al.ToolListWrap([]),
)
rows = json.loads(sys.argv[3])
sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
outputs = [asyncio.run(loop.run(sampling, **row)) for row in rows]

worker = object.__new__(al.AgentLoopWorker)
worker.rollout_config = config.actor_rollout_ref.rollout
worker.tokenizer, worker.processor = tokenizer, None
worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
worker.mm_processor_kwargs = {}
internal = [
    asyncio.run(worker._agent_loop_postprocess(o, False, **row)) for o, row in zip(outputs, rows)
]
batch = worker._postprocess(internal, input_non_tensor_batch=None)
rm = batch.batch["rm_scores"]
print(json.dumps({
    "base": [c.__name__ for c in cls.__mro__],
    "output_type": type(outputs[0]).__name__,
    "rewards": [o.reward_score for o in outputs],
    "num_turns": batch.non_tensor_batch["__num_turns__"].tolist(),
    "responses_shape": list(batch.batch["responses"].shape),
    "mask_sums": batch.batch["response_mask"].sum(dim=1).tolist(),
    "lengths": [len(o.response_ids) for o in outputs],
    "rm_scores_sum": rm.sum(dim=1).tolist(),
    "rm_last": [int(r.nonzero().max()) if r.any() else -1 for r in rm],
    "has_rollout_log_probs": "rollout_log_probs" in batch.batch.keys(),
    "extra_keys": sorted(k for k in batch.non_tensor_batch if k.startswith("rollserve_")),
}))
"""


def verl_python() -> str | None:
    """A Python where veRL's agent loop imports: this one, or `$ROLLSERVE_VERL_PYTHON`."""
    if adapter.verl_available():
        return sys.executable
    return os.environ.get("ROLLSERVE_VERL_PYTHON") or None


@pytest.mark.skipif(
    verl_python() is None,
    reason="veRL is not installed here (its CPU install needs torch, Ray, hydra and more): set "
    "ROLLSERVE_VERL_PYTHON to a Python where verl.experimental.agent_loop imports",
)
def test_the_agent_loop_runs_over_verls_own_base(stack: Stack, tiny_model_dir: Path) -> None:
    python = verl_python()
    assert python is not None
    rows = [
        verl_row("VERL-ADD", "What is 2+2?", "4", 10),
        verl_row("VERL-TWO", "What is 3 times 4?", "12", 11),
        verl_row("VERL-WRONG", "What is 2+2?", "4", 12),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, "-c", VERL_SCRIPT, stack.gateway_url, str(tiny_model_dir), json.dumps(rows)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["base"][:3] == ["RollserveAgentLoop", "RollserveAgentLoopMixin", "AgentLoopBase"]
    assert result["output_type"] == "AgentLoopOutput"
    assert result["rewards"] == [1.0, 1.0, 0.0]
    assert result["num_turns"] == [2, 4, 2]
    assert result["responses_shape"] == [3, 64]
    assert all(0 < n <= 64 for n in result["lengths"])
    assert result["mask_sums"][1] < result["lengths"][1]  # the reminder is masked out
    assert result["rm_scores_sum"] == [1.0, 1.0, 0.0]
    assert result["rm_last"][:2] == [n - 1 for n in result["lengths"][:2]]
    assert result["has_rollout_log_probs"] is True
    assert "rollserve_job_id" in result["extra_keys"]
