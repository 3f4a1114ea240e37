"""The SkyRL adapter (`trainers.skyrl`): rollserve trajectories → SkyRL's `GeneratorOutput`.

The conversion tests run everywhere, against SkyRL's keys as read from its source
(NovaSky-AI/SkyRL a956457, `skyrl/train/generators/base.py`, and the released `skyrl==0.4.0`),
and check every output with the checks of SkyRL's own `validate_generator_output`
(`skyrl/train/utils/trainer_utils.py`), restated here. The end-to-end test runs
`RollserveGenerator.generate` against a whole stack (embedded Redis, prefork workers, the
gateway, the development server playing scripted answers). SkyRL itself does not install on
this machine's CPU setup (see docs/training.md): the last test runs `generate` over SkyRL's real
`GeneratorInterface`, `TrajectoryID` and `validate_generator_output` in a Python where SkyRL
imports (this one, or `ROLLSERVE_SKYRL_PYTHON`), and skips with the reason otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.schemas import EnvTurn, JobStatus, ModelTurn, Segment, StageError, Timing, Trajectory
from deploy.stack import Stack
from tests.support.stack import start_stack
from trainers import skyrl as adapter
from trainers.skyrl import (
    GENERATOR_INPUT_KEYS,
    GENERATOR_OUTPUT_KEYS,
    generator_output,
    row_groups,
    sampling_from_skyrl,
    stop_reason,
    task_from_env_row,
    wants_logprobs,
)

pytestmark = pytest.mark.full

SKYRL_GENERATOR_OUTPUT = {
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
}
"""`GeneratorOutput`'s keys at NovaSky-AI/SkyRL a956457 (skyrl 0.4.0 adds
`rollout_sample_support`)."""

ROOT = Path(__file__).resolve().parents[2]

SKYRL_GENERATOR_INPUT = {
    "prompts",
    "env_classes",
    "env_extras",
    "sampling_params",
    "trajectory_ids",
    "batch_metadata",
}


@dataclass
class TrajectoryID:
    """SkyRL's `TrajectoryID` (a dataclass of these two fields)."""

    instance_id: str
    repetition_id: int


def validate(num_prompts: int, output: dict[str, Any]) -> None:
    """The checks of SkyRL's `validate_generator_output` (non-step-wise), restated."""
    responses = output["response_ids"]
    assert len(responses) > 0
    assert num_prompts == len(responses) == len(output["prompt_token_ids"])
    for key in (
        "response_ids",
        "loss_masks",
        "rewards",
        "rollout_logprobs",
        "stop_reasons",
        "trajectory_ids",
        "rollout_expert_indices",
        "is_last_step",
        "pixel_values",
        "image_grid_thw",
    ):
        if isinstance(output[key], list):
            assert len(output[key]) == len(responses), key
    for i, (response, mask) in enumerate(zip(responses, output["loss_masks"], strict=True)):
        assert len(response) == len(mask)
        if output["rollout_logprobs"]:
            assert len(response) == len(output["rollout_logprobs"][i])
    assert all(not isinstance(r, list) for r in output["rewards"])


def validate_step_wise(output: dict[str, Any]) -> None:
    """The checks of SkyRL's `validate_generator_output` with `step_wise=True` (any number of
    rows; `_validate_step_wise_fields`), restated."""
    responses = output["response_ids"]
    assert len(responses) == len(output["prompt_token_ids"]) > 0
    for key in ("loss_masks", "rewards", "rollout_logprobs", "stop_reasons", "is_last_step"):
        assert len(output[key]) == len(responses), key
    last, ids = output["is_last_step"], [str(t) for t in output["trajectory_ids"]]
    assert len(ids) == len(responses) and last[-1] is True
    seen: set[str] = set()
    for i, tid in enumerate(ids):
        if i and tid != ids[i - 1]:
            assert tid not in seen, "the rows of one trajectory must be adjacent"
        seen.add(tid)
        if i + 1 < len(ids):
            assert last[i] is (ids[i + 1] != tid), i


def trajectory(**overrides: Any) -> Trajectory:
    """A finished two-call episode: prompt [1, 2, 3]; the model says [10, 11], the environment
    answers [20, 21, 22], the model says [12, 13]."""
    fields: dict[str, Any] = {
        "job_id": "job-1",
        "group_id": "group-1",
        "instance_id": "0",
        "data_source": "math",
        "status": JobStatus.completed,
        "reward": 1.0,
        "stop_reason": "answer",
        "timing": Timing(run=1.5, llm=1.0, tools=0.3),
        "created_at": 100.0,
        "finished_at": 102.5,
        "turns": [
            ModelTurn(
                prompt_ids=[1, 2, 3],
                output_ids=[10, 11],
                logprobs=[-0.1, -0.2],
                finish_reason="stop",
                text="a",
            ),
            EnvTurn(observation_ids=[20, 21, 22], text="obs"),
            ModelTurn(
                prompt_ids=[20, 21, 22],
                output_ids=[12, 13],
                logprobs=[-0.3, -0.4],
                finish_reason="stop",
                text="b",
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
            segment_start="history_changed",
        ),
        EnvTurn(observation_ids=[23], text="obs 2"),
        ModelTurn(
            prompt_ids=[23], output_ids=[16], logprobs=[-0.7], finish_reason="stop", text="d"
        ),
    ]
    segment = Segment(
        reason="history_changed",
        first_turn=3,
        prompt_ids=[1, 2, 3, 30, 31],
        response_ids=[14, 15, 23, 16],
        loss_mask=[1, 1, 0, 1],
        logprobs=[-0.5, -0.6, None, -0.7],
    )
    return trajectory(**{"turns": [*base.turns, *later], "segments": [segment], **overrides})


def failed_trajectory(**overrides: Any) -> Trajectory:
    error = StageError(stage="init", type="TaskValidationError", message="bad task")
    empty: dict[str, Any] = {
        "status": JobStatus.failed,
        "reward": None,
        "error": error,
        "turns": [],
        "prompt_ids": [],
        "response_ids": [],
        "loss_mask": [],
        "logprobs": [],
    }
    return trajectory(**{**empty, **overrides})


# ----------------------------------------------------------------------------- keys


def test_the_keys_are_skyrls_generator_output_keys() -> None:
    assert set(GENERATOR_OUTPUT_KEYS) == SKYRL_GENERATOR_OUTPUT | {"rollout_sample_support"}
    assert set(GENERATOR_INPUT_KEYS) == SKYRL_GENERATOR_INPUT
    assert set(generator_output([trajectory()])) == set(GENERATOR_OUTPUT_KEYS)


# ----------------------------------------------------------------------------- conversion


def test_trajectories_become_a_generator_output() -> None:
    ids = [TrajectoryID("0", 0), TrajectoryID("0", 1)]
    second = trajectory(job_id="job-2", reward=0.0)
    out = generator_output([trajectory(), second], trajectory_ids=ids, groups=[[0, 1]])
    validate(2, out)
    assert out["prompt_token_ids"] == [[1, 2, 3], [1, 2, 3]]
    assert out["response_ids"][0] == [10, 11, 20, 21, 22, 12, 13]
    assert out["loss_masks"][0] == [1, 1, 0, 0, 0, 1, 1]
    assert out["rollout_logprobs"][0] == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert out["rewards"] == [1.0, 0.0]
    assert out["stop_reasons"] == ["stop", "stop"]
    assert out["trajectory_ids"] == ids
    assert out["trajectory_generation_times"] == [2.5, 2.5]
    assert out["trajectory_time_splits"] == {"llm": [1.0, 1.0], "env": [0.3, 0.3]}
    assert out["env_metrics"][1]["rollserve_job_id"] == "job-2"
    for key in ("rollout_expert_indices", "rollout_sample_support", "is_last_step"):
        assert out[key] is None
    assert out["pixel_values"] is None and out["image_grid_thw"] is None
    metrics = out["rollout_metrics"]
    assert metrics["generate/avg_num_tokens"] == 7.0
    assert metrics["generate/avg_assistant_tokens"] == 4.0
    assert metrics["generate/avg_num_turns"] == 4.0
    assert metrics["generate/num_error_trajectories"] == 0
    assert metrics["rollserve/mean_reward"] == 0.5


def test_logprobs_are_none_when_skyrl_did_not_ask_for_them() -> None:
    assert generator_output([trajectory()], with_logprobs=False)["rollout_logprobs"] is None
    assert wants_logprobs({"logprobs": 0}) is True
    assert wants_logprobs({"logprobs": None}) is False
    assert wants_logprobs(None) is False


def test_stop_reasons_follow_skyrls_stop_and_length() -> None:
    assert stop_reason(trajectory()) == "stop"
    assert stop_reason(trajectory(truncated=True, stop_reason="token_budget")) == "length"
    cut_call = trajectory().turns[:1]
    cut_call[0] = cut_call[0].model_copy(update={"finish_reason": "length"})
    cut = trajectory(turns=cut_call, response_ids=[10, 11], loss_mask=[1, 1], logprobs=[-0.1, -0.2])
    assert stop_reason(cut) == "length"
    assert stop_reason(failed_trajectory()) == "error"


def test_a_failed_job_masks_its_whole_group() -> None:
    rows = [trajectory(), failed_trajectory(job_id="job-2"), trajectory(job_id="job-3")]
    out = generator_output(rows, groups=[[0, 1], [2]])
    validate(3, out)
    assert out["prompt_token_ids"][1] == [0] and out["response_ids"][1] == [0]
    assert out["loss_masks"] == [[0] * 7, [0], [1, 1, 0, 0, 0, 1, 1]]
    assert out["rewards"] == [1.0, 0.0, 1.0]
    assert out["stop_reasons"] == ["stop", "error", "stop"]
    assert out["rollout_metrics"]["generate/num_error_trajectories"] == 1
    assert out["rollout_metrics"]["generate/num_masked_trajectories"] == 2
    alone = generator_output(rows, groups=[[0, 1], [2]], mask_failed_groups=False)
    assert alone["loss_masks"][0] == [1, 1, 0, 0, 0, 1, 1]
    partial = failed_trajectory(
        status=JobStatus.timed_out,
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11],
        loss_mask=[1, 1],
        logprobs=[-0.1, -0.2],
    )
    kept = generator_output([partial])
    assert kept["response_ids"] == [[10, 11]] and kept["loss_masks"] == [[0, 0]]
    assert kept["trajectory_generation_times"] == [2.5]


def test_long_responses_are_cut_and_filters_apply_as_skyrls_options() -> None:
    out = generator_output([trajectory()], max_response_tokens=3)
    validate(1, out)
    assert out["response_ids"] == [[10, 11, 20]] and out["loss_masks"] == [[1, 1, 0]]
    assert out["rollout_logprobs"] == [[-0.1, -0.2, 0.0]]
    assert out["stop_reasons"] == ["length"]
    filtered = generator_output(
        [trajectory(truncated=True)], apply_overlong_filtering=True, zero_reward_on_non_stop=True
    )
    assert filtered["loss_masks"] == [[0] * 7] and filtered["rewards"] == [0.0]


def test_step_wise_each_segment_is_a_row_with_its_jobs_id_and_reward() -> None:
    ids = [TrajectoryID("0", 0), TrajectoryID("0", 1)]
    second = trajectory(job_id="job-2", reward=0.0)
    out = generator_output([two_segments(), second], trajectory_ids=ids, step_wise=True)
    validate_step_wise(out)
    assert out["prompt_token_ids"] == [[1, 2, 3], [1, 2, 3, 30, 31], [1, 2, 3]]
    assert out["response_ids"][:2] == [[10, 11, 20, 21, 22, 12, 13], [14, 15, 23, 16]]
    assert out["loss_masks"][1] == [1, 1, 0, 1]
    assert out["rollout_logprobs"][1] == [-0.5, -0.6, 0.0, -0.7]
    assert out["rewards"] == [1.0, 1.0, 0.0]
    assert out["is_last_step"] == [False, True, True]
    assert out["trajectory_ids"] == [ids[0], ids[0], ids[1]]
    assert out["trajectory_generation_times"] == [2.5, 2.5, 2.5]
    assert [m.get("rollserve_segment_reason") for m in out["env_metrics"]] == [
        "start",
        "history_changed",
        None,
    ]
    assert out["rollout_metrics"]["rollserve/mean_reward"] == 0.5  # per job, not per row
    assert out["rollout_metrics"]["rollserve/later_segments"] == 1


def test_step_wise_a_one_segment_trajectory_is_one_last_step() -> None:
    ids = [TrajectoryID("0", 0)]
    out = generator_output([trajectory()], trajectory_ids=ids, step_wise=True)
    validate_step_wise(out)
    plain = generator_output([trajectory()], trajectory_ids=ids)
    assert out["is_last_step"] == [True] and plain["is_last_step"] is None
    assert {k: v for k, v in out.items() if k != "is_last_step"} == {
        k: v for k, v in plain.items() if k != "is_last_step"
    }
    with pytest.raises(ValueError, match="trajectory_ids"):
        generator_output([trajectory()], step_wise=True)


def test_outside_step_wise_mode_a_job_is_its_first_segment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        out = generator_output([two_segments()])
    validate(1, out)
    assert out["prompt_token_ids"] == [[1, 2, 3]]
    assert out["response_ids"] == [[10, 11, 20, 21, 22, 12, 13]]
    assert out["rewards"] == [1.0]
    assert "1 later segment(s) left out" in caplog.text


def test_a_cut_episode_ends_its_last_segment_with_length() -> None:
    cut = two_segments(truncated=True)
    out = generator_output([cut], trajectory_ids=[TrajectoryID("0", 0)], step_wise=True)
    assert out["stop_reasons"] == ["stop", "length"]


def test_a_misaligned_trajectory_is_refused() -> None:
    with pytest.raises(ValueError, match="aligned"):
        generator_output([trajectory(loss_mask=[1])])


# ----------------------------------------------------------------------------- rows and parameters


def test_rows_of_one_instance_form_one_group() -> None:
    ids = [TrajectoryID("a", 0), TrajectoryID("a", 1), TrajectoryID("b", 0), TrajectoryID("a", 0)]
    assert row_groups(ids) == [[0, 1], [2], [3]]
    assert row_groups(None, ["x", "x", "y"]) == [[0, 1], [2]]
    assert row_groups(None) == []


def skyrl_row() -> tuple[list[dict[str, str]], str, dict[str, Any]]:
    """A row as SkyRL's `examples/train/gsm8k/gsm8k_dataset.py` writes it: prompt, env class,
    and the other columns as `env_extras`."""
    prompt = [{"role": "user", "content": "Natalia sold 48 clips... Let's think step by step"}]
    extras = {
        "data_source": "openai/gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 7},
    }
    return prompt, "gsm8k", extras


def test_a_skyrl_gsm8k_row_becomes_a_rollserve_task() -> None:
    prompt, env_class, extras = skyrl_row()
    assert task_from_env_row(prompt, env_class, extras, "7", {"gsm8k": "math"}) == {
        "data_source": "math",
        "question": "Natalia sold 48 clips... Let's think step by step",
        "answer": "72",
        "instance_id": "7",
    }
    assert task_from_env_row(prompt, None, extras)["data_source"] == "openai/gsm8k"
    explicit = {"data_source": "stem", "question": "Q?", "choices": ["a", "b"], "answer": "B"}
    assert task_from_env_row(prompt, env_class, {"rollserve_task": explicit}) == explicit
    with pytest.raises(ValueError, match="ground truth"):
        task_from_env_row(prompt, env_class, {})
    with pytest.raises(ValueError, match="env_class"):
        task_from_env_row(prompt, None, None)


def test_skyrl_sampling_params_become_rollserve_sampling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm_params = {
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": 1024,
        "temperature": 1,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "logprobs": 0,
        "stop": None,
    }  # as SkyRL's get_vllm_sampling_params builds them
    assert sampling_from_skyrl(vllm_params) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 1024,
    }
    with caplog.at_level(logging.WARNING):
        out = sampling_from_skyrl({**vllm_params, "top_k": 5, "min_p": 0.1, "stop": ["</a>"]})
    assert out["stop"] == ["</a>"]
    assert "top_k=5" in caplog.text and "min_p=0.1" in caplog.text
    assert sampling_from_skyrl(None) == {}
    assert sampling_from_skyrl({"seed": 3})["seed"] == 3


def test_without_skyrl_the_class_stands_on_the_standalone_interface() -> None:
    if adapter.skyrl_base_module() is not None:
        pytest.skip("SkyRL is installed here: RollserveGenerator subclasses its interface")
    cls = adapter.RollserveGenerator
    assert issubclass(cls, adapter.StandaloneGeneratorInterface)
    assert cls.__module__ == "trainers.skyrl" and cls.__qualname__ == "RollserveGenerator"
    generator = cls(url="http://127.0.0.1:1", max_turns=2, max_total_tokens=64)
    assert generator.agent == {"max_turns": 2, "max_total_tokens": 64}


# ----------------------------------------------------------------------------- end to end

SCRIPT: list[dict[str, Any]] = [
    {"match": "SKY-ADD", "samples": [["So 2+2 = \\boxed{4}."], ["I think it is \\boxed{5}."]]},
    {"match": "SKY-TWO", "samples": [["Let me think about 3 times 4 first.", "\\boxed{12}"]]},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("skyrl-stack")
    running = start_stack(data, tiny_model_dir, script=SCRIPT)
    yield running
    running.stop()


def input_batch() -> dict[str, Any]:
    """Two prompts as SkyRL's `prepare_generator_input` lays them out: the first with 2
    samples, the second with 1 (two group sizes, so two rollserve batches)."""
    add = [{"role": "user", "content": "SKY-ADD: What is 2+2?"}]
    two = [{"role": "user", "content": "SKY-TWO: What is 3 times 4?"}]
    extras = [
        {"reward_spec": {"method": "rule", "ground_truth": "4"}},
        {"reward_spec": {"method": "rule", "ground_truth": "4"}},
        {"reward_spec": {"method": "rule", "ground_truth": "12"}},
    ]
    return {
        "prompts": [add, add, two],
        "env_classes": ["gsm8k", "gsm8k", "gsm8k"],
        "env_extras": extras,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "logprobs": 0,
                            "seed": 0, "top_k": -1, "min_p": 0.0},
        "trajectory_ids": [TrajectoryID("0", 0), TrajectoryID("0", 1), TrajectoryID("1", 0)],
        "batch_metadata": None,
    }  # fmt: skip


async def test_the_generator_returns_graded_groups_in_input_order(stack: Stack) -> None:
    if adapter.skyrl_base_module() is not None:
        pytest.skip("SkyRL is installed here: covered by the test over its own interface")
    generator = adapter.RollserveGenerator(url=stack.gateway_url, data_source_map={"gsm8k": "math"})
    batch = input_batch()
    out = await generator.generate(batch)
    validate(3, out)
    assert out["rewards"] == [1.0, 0.0, 1.0]  # samples 0 and 1 of one group: seeds 0 and 1
    assert out["stop_reasons"] == ["stop", "stop", "stop"]
    assert out["prompt_token_ids"][0] == out["prompt_token_ids"][1]
    assert out["prompt_token_ids"][0] != out["prompt_token_ids"][2]
    assert out["trajectory_ids"] == batch["trajectory_ids"]
    assert out["loss_masks"][0] == [1] * len(out["response_ids"][0])
    assert 0 in out["loss_masks"][2]  # the reminder between the two turns is masked out
    assert out["rollout_logprobs"] is not None
    assert all(lp <= 0.0 for lp in out["rollout_logprobs"][2])
    assert out["rollout_metrics"]["generate/num_error_trajectories"] == 0
    assert out["trajectory_generation_times"] is not None
    assert {m["rollserve_status"] for m in out["env_metrics"]} == {"completed"}


# ----------------------------------------------------------------------------- over SkyRL's code

SKYRL_SCRIPT = r"""
import asyncio, importlib, json, sys
import trainers.skyrl as adapter

module = adapter.skyrl_base_module()
base = importlib.import_module(module)
utils = importlib.import_module(module.replace("generators.base", "utils.trainer_utils"))
batch = json.loads(sys.argv[2])
batch["trajectory_ids"] = [base.TrajectoryID(**t) for t in batch["trajectory_ids"]]
generator = adapter.RollserveGenerator(url=sys.argv[1], data_source_map={"gsm8k": "math"})
out = asyncio.run(generator.generate(batch))
utils.validate_generator_output(len(batch["prompts"]), out)
print(json.dumps({
    "module": module,
    "mro": [c.__name__ for c in type(generator).__mro__],
    "is_interface": isinstance(generator, base.GeneratorInterface),
    "missing_keys": sorted(set(base.GeneratorOutput.__annotations__) - set(out)),
    "input_keys": sorted(base.GeneratorInput.__annotations__),
    "rewards": out["rewards"],
    "stop_reasons": out["stop_reasons"],
    "ids": [t.to_string() for t in out["trajectory_ids"]],
}))
"""


def skyrl_python() -> str | None:
    """A Python where SkyRL's generator interface imports: this one, or
    `$ROLLSERVE_SKYRL_PYTHON`."""
    if adapter.skyrl_base_module() is not None:
        return sys.executable
    return os.environ.get("ROLLSERVE_SKYRL_PYTHON") or None


@pytest.mark.skipif(
    skyrl_python() is None,
    reason="SkyRL is not installed here: skyrl 0.4.0 and skyrl-train 0.3.1 need Python 3.12, "
    "where PyPI has only the CUDA build of torch, which SkyRL's generator module imports; set "
    "ROLLSERVE_SKYRL_PYTHON to a Python where it imports (docs/training.md says how)",
)
def test_the_generator_runs_over_skyrls_own_interface(stack: Stack) -> None:
    python = skyrl_python()
    assert python is not None
    batch = input_batch()
    batch["trajectory_ids"] = [vars(t) for t in batch["trajectory_ids"]]
    done = subprocess.run(
        [python, "-c", SKYRL_SCRIPT, stack.gateway_url, json.dumps(batch)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mro"][:3] == [
        "RollserveGenerator",
        "RollserveGeneratorMixin",
        "GeneratorInterface",
    ]
    assert result["is_interface"] is True
    assert result["missing_keys"] == []
    assert set(result["input_keys"]) == set(GENERATOR_INPUT_KEYS)
    assert result["rewards"] == [1.0, 0.0, 1.0]
    assert result["stop_reasons"] == ["stop", "stop", "stop"]
    assert result["ids"] == ["0_0", "0_1", "1_0"]
