"""SkyRL adapter: `RollserveGenerator`, a `GeneratorInterface` whose episodes run in rollserve.

SkyRL's trainer calls `await generator.generate(input_batch)` once per step with a
`GeneratorInput`: `prompts` (one chat per row), `env_classes`, `env_extras` (the dataset row's
other columns), `sampling_params` (vLLM's, e.g. `temperature`, `top_p`, `max_tokens`,
`logprobs`), `trajectory_ids` (`TrajectoryID(instance_id, repetition_id)`: the rows of one
prompt repeated `n_samples_per_prompt` times) and `batch_metadata`. `RollserveGenerator`
makes one rollserve group of each run of rows sharing an `instance_id` (so rollserve's group
is SkyRL's GRPO group, seeds `seed + i`), submits them as one batch (`POST /v1/batches`;
one batch per group size), streams the results and returns a `GeneratorOutput` in the input's
order: `prompt_token_ids`, `response_ids`, `rewards` (rollserve's EVAL), `loss_masks`,
`stop_reasons` (`stop`, `length` when truncated, `error` when the job did not complete),
`rollout_logprobs` (0.0 off the mask; None when `logprobs` was not asked for),
`rollout_metrics`, `trajectory_ids`, `trajectory_generation_times`, `trajectory_time_splits`
(`llm`, `env`), `env_metrics`, and None for the fields it has no data for.

A trajectory of several segments (a harness edited or summarised its history, so a model call's
prompt did not extend the sequence before it: `core.schemas.Segment`) is several training
samples in SkyRL's step-wise mode (`generator.step_wise_trajectories`; give the generator
`step_wise=True` with it): each segment is a row of its own, the job's rows adjacent and in order,
each with the job's `trajectory_ids` entry and reward, `is_last_step` true on the last. SkyRL
computes the advantage from each trajectory's last step and gives it to all of its steps
(`RayPPOTrainer.compute_advantages_and_returns`), so the segments of one job share the job's
advantage and the job counts once in its group. Outside step-wise mode SkyRL takes exactly one row
per input row: a job is then its first segment alone (a warning says how many were left out). A
one-segment trajectory is one row either way.

Field names were read from NovaSky-AI/SkyRL at commit
a9564572eb8e91076be43c1bd5e4615e3de17265 (2026-08-21), `skyrl/train/generators/base.py`
(`GeneratorInterface`, `GeneratorInput`, `GeneratorOutput`, `TrajectoryID`),
`skyrl/train/generators/utils.py` (`prepare_generator_input`, `apply_overlong_filtering`),
`skyrl/train/utils/trainer_utils.py` (`validate_generator_output`) and
`skyrl/train/entrypoints/main_base.py` (`BasePPOExp.get_generator`), and checked against the
released `skyrl==0.4.0` wheel (which adds `rollout_sample_support`) and `skyrl-train==0.3.1`
(`skyrl_train.generators.base`, the older layout).

SkyRL is imported only when `RollserveGenerator` is first looked up (PEP 562): it subclasses
`GeneratorInterface` from `skyrl.train.generators.base` (or `skyrl_train.generators.base`)
when one is installed, else a stand-in with the same abstract `generate`. Plug it in by
overriding `BasePPOExp.get_generator`::

    class RollserveExp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return RollserveGenerator(
                url="http://rollserve-gateway:8600",
                step_wise=cfg.generator.step_wise_trajectories,
            )
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import types
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from api.client import AsyncRolloutClient
from core.flatten import segments_and_turns
from core.schemas import EnvTurn, JobStatus, ModelTurn, Trajectory
from trainers.verl import explicit_task, plain, simple_task

logger = logging.getLogger(__name__)

GENERATOR_OUTPUT_KEYS = (
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
    "rollout_sample_support",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
)
"""Every key of SkyRL's `GeneratorOutput` (skyrl 0.4.0), all of which `generator_output` sets."""

GENERATOR_INPUT_KEYS = (
    "prompts",
    "env_classes",
    "env_extras",
    "sampling_params",
    "trajectory_ids",
    "batch_metadata",
)
"""The keys of SkyRL's `GeneratorInput`."""

FAILED = frozenset({JobStatus.failed, JobStatus.cancelled, JobStatus.timed_out})


# ----------------------------------------------------------------------------- rows → groups


def task_from_env_row(
    prompt: Any,
    env_class: str | None,
    env_extras: Mapping[str, Any] | None,
    instance_id: Any = None,
    data_source_map: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The rollserve task for one SkyRL row.

    `env_extras.rollserve_task` (or `env_extras.extra_info.rollserve_task`) is used as it is.
    Otherwise the row is read as SkyRL's own datasets lay it out: the handler is
    `data_source_map[env_class]` (the `env_class` itself when unmapped; the row's
    `data_source` when it has no env class), the question the prompt's last user message, the
    answer `reward_spec.ground_truth`, the instance id `instance_id` (SkyRL's uid)."""
    extras = env_extras or {}
    task = explicit_task(extras)
    if task is not None:
        return task
    key = env_class or plain(extras.get("data_source"))
    if not key:
        raise ValueError("the row has neither a rollserve_task, an env_class nor a data_source")
    mapped = (data_source_map or {}).get(str(key), str(key))
    spec = plain(extras.get("reward_spec")) or {}
    ground_truth = spec.get("ground_truth") if isinstance(spec, dict) else None
    return simple_task(mapped, prompt, ground_truth, instance_id)


def row_groups(
    trajectory_ids: Sequence[Any] | None, rows: Sequence[Any] | None = None
) -> list[list[int]]:
    """Runs of consecutive rows that form one group: rows sharing a `trajectory_ids[i]
    .instance_id` (as SkyRL's `prepare_generator_input` lays out the samples of one prompt),
    or without ids, consecutive equal `rows`."""
    keys: Sequence[Any]
    if trajectory_ids is not None:
        keys = [getattr(t, "instance_id", t) for t in trajectory_ids]
    elif rows is not None:
        keys = rows
    else:
        return []
    groups: list[list[int]] = []
    for index, key in enumerate(keys):
        if groups and keys[groups[-1][-1]] == key:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def sampling_from_skyrl(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """rollserve `sampling` from SkyRL's (vLLM's) sampling parameters: `temperature`, `top_p`,
    `max_tokens`, `stop`, `seed` pass through; rollserve has no top-k nor min-p, so values
    other than the neutral ones are logged and not applied."""
    params = sampling_params or {}
    sampling: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if params.get(key) is not None:
            sampling[key] = float(params[key])
    if params.get("max_tokens") is not None:
        sampling["max_tokens"] = int(params["max_tokens"])
    if params.get("seed") is not None:
        sampling["seed"] = int(params["seed"])
    stop = plain(params.get("stop"))
    if stop:
        sampling["stop"] = [str(s) for s in stop]
    top_k = params.get("top_k")
    if top_k is not None and int(top_k) not in (-1, 0):
        logger.warning("rollserve samples without top-k: top_k=%s is not applied", top_k)
    min_p = params.get("min_p")
    if min_p is not None and float(min_p) != 0.0:
        logger.warning("rollserve samples without min-p: min_p=%s is not applied", min_p)
    return sampling


def wants_logprobs(sampling_params: Mapping[str, Any] | None) -> bool:
    """SkyRL returns `rollout_logprobs` when its sampling params ask for `logprobs` (not None)."""
    return sampling_params is not None and sampling_params.get("logprobs") is not None


# ----------------------------------------------------------------------------- trajectories → rows


def failed(trajectory: Trajectory) -> bool:
    """True for a job that ended without a grade (failed, cancelled, timed out, no reward)."""
    return trajectory.status in FAILED or trajectory.reward is None


def stop_reason(
    trajectory: Trajectory,
    turns: Sequence[ModelTurn | EnvTurn] | None = None,
    last: bool = True,
) -> str:
    """SkyRL's stop reason: `error` for a job that did not complete, `length` when rollserve
    cut the episode (token budget, time budget, context length), else the last model call's
    finish reason (`stop`, or `length` when it ran out of `max_tokens`). For one segment of
    the trajectory: its `turns`, and whether it is the `last` (the one a cut ends)."""
    if failed(trajectory):
        return "error"
    if trajectory.truncated and last:
        return "length"
    calls = [t for t in (trajectory.turns if turns is None else turns) if isinstance(t, ModelTurn)]
    reason = calls[-1].finish_reason if calls else None
    return reason or "stop"


def _elapsed(trajectory: Trajectory) -> float | None:
    if trajectory.created_at is None or trajectory.finished_at is None:
        return None
    return max(0.0, trajectory.finished_at - trajectory.created_at)


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def generator_output(
    trajectories: Sequence[Trajectory],
    *,
    trajectory_ids: Sequence[Any] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    with_logprobs: bool = True,
    mask_failed_groups: bool = True,
    max_response_tokens: int | None = None,
    zero_reward_on_non_stop: bool = False,
    apply_overlong_filtering: bool = False,
    step_wise: bool = False,
) -> dict[str, Any]:
    """SkyRL's `GeneratorOutput` (every key) for rollserve trajectories, one per input row
    (with `step_wise`, one row per segment: see the module docstring).

    A job that did not complete keeps what it has (a lone `0` id where it has nothing, as
    SkyRL's Harbor generator does), with an all-zero mask, reward 0.0 and stop reason
    `error`; with `mask_failed_groups`, so are the other rows of its group (their rewards
    kept), as a group missing a sample would skew its advantages. Responses longer than
    `max_response_tokens` are cut (stop reason `length`). `zero_reward_on_non_stop` and
    `apply_overlong_filtering` do what SkyRL's generator options of those names do, row by
    row."""
    if step_wise and trajectory_ids is None:
        raise ValueError("step-wise output needs the input's trajectory_ids")
    bad = [failed(t) for t in trajectories]
    masked = list(bad)
    if mask_failed_groups:
        for group in groups or []:
            if any(bad[i] for i in group):
                for i in group:
                    masked[i] = True
    later = sum(len(t.segments) for t in trajectories)
    if later and not step_wise:
        logger.warning(
            "%d later segment(s) left out: SkyRL takes one row per prompt outside step-wise "
            "mode (generator.step_wise_trajectories with step_wise=True trains every segment)",
            later,
        )
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    masks: list[list[int]] = []
    logprobs: list[list[float]] = []
    rewards: list[float] = []
    reasons: list[str] = []
    env_metrics: list[dict[str, Any]] = []
    owners: list[int] = []  # the trajectory of each row
    last_steps: list[bool] = []
    for i, traj in enumerate(trajectories):
        parts = segments_and_turns(traj)
        rows = parts if step_wise else parts[:1]
        for k, (part, turns) in enumerate(rows):
            response = list(part.response_ids)
            mask = [int(m) for m in part.loss_mask]
            lps = [0.0 if lp is None else float(lp) for lp in part.logprobs]
            if len(mask) != len(response) or (with_logprobs and len(lps) != len(response)):
                raise ValueError(f"job {traj.job_id}: loss_mask/logprobs not aligned with response")
            reason = stop_reason(traj, turns, last=k == len(parts) - 1)
            if max_response_tokens is not None and len(response) > max_response_tokens:
                response, mask = response[:max_response_tokens], mask[:max_response_tokens]
                lps = lps[:max_response_tokens]
                reason = "length" if reason != "error" else reason
            reward = 0.0 if traj.reward is None or bad[i] else float(traj.reward)
            prompt = list(part.prompt_ids)
            if bad[i]:
                prompt, response = prompt or [0], response or [0]
                lps = lps if len(lps) == len(response) else [0.0] * len(response)
            if masked[i] or len(mask) != len(response):
                mask = [0] * len(response)
            if zero_reward_on_non_stop and reason != "stop":
                reward = 0.0
            if apply_overlong_filtering and reason != "stop":
                mask = [0] * len(response)
            metrics_row: dict[str, Any] = {
                "rollserve_job_id": traj.job_id,
                "rollserve_status": str(traj.status),
                "rollserve_stop_reason": traj.stop_reason,
                "tool_calls": traj.tool_calls,
                "malformed_tool_calls": traj.malformed_tool_calls,
            }
            if len(parts) > 1:
                metrics_row.update(rollserve_segment=k, rollserve_segment_reason=part.reason)
            prompts.append(prompt)
            responses.append(response)
            masks.append(mask)
            logprobs.append(lps)
            rewards.append(reward)
            reasons.append(reason)
            env_metrics.append(metrics_row)
            owners.append(i)
            last_steps.append(k == len(rows) - 1)
    elapsed = [_elapsed(t) for t in trajectories]
    times = None if any(e is None for e in elapsed) else [float(e or 0.0) for e in elapsed]
    splits = {
        "llm": [float(trajectories[i].timing.llm) for i in owners],
        "env": [float(trajectories[i].timing.tools) for i in owners],
    }
    turns_per_job = [
        sum(isinstance(x, ModelTurn | EnvTurn) for x in t.turns) + 1
        for i, t in enumerate(trajectories)
        if not bad[i]
    ]
    lengths = [len(r) for r in responses]
    trained = [False] * len(trajectories)
    for i, mask in zip(owners, masks, strict=True):
        trained[i] |= any(mask)
    metrics: dict[str, Any] = {
        "generate/min_num_tokens": min(lengths, default=0),
        "generate/max_num_tokens": max(lengths, default=0),
        "generate/avg_num_tokens": _mean([float(n) for n in lengths]),
        "generate/avg_assistant_tokens": _mean([float(sum(m)) for m in masks]),
        "generate/num_error_trajectories": sum(bad),
        "generate/num_masked_trajectories": trained.count(False),
        "generate/avg_num_turns": _mean([float(n) for n in turns_per_job]),
        "rollserve/mean_reward": _mean(
            [r for r, last in zip(rewards, last_steps, strict=True) if last]
        ),
        "rollserve/truncated": sum(1 for t in trajectories if t.truncated),
        "rollserve/later_segments": later,
    }
    if times:
        metrics["generate/trajectory_time_completion_mean"] = _mean(times)
    return {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": masks,
        "stop_reasons": reasons,
        "rollout_metrics": metrics,
        "rollout_logprobs": logprobs if with_logprobs else None,
        "trajectory_ids": (
            [trajectory_ids[i] for i in owners] if trajectory_ids is not None else None
        ),
        "trajectory_generation_times": None if times is None else [times[i] for i in owners],
        "trajectory_time_splits": splits if trajectories else None,
        "rollout_expert_indices": None,
        "rollout_sample_support": None,
        "is_last_step": last_steps if step_wise else None,
        "env_metrics": env_metrics,
        "pixel_values": None,
        "image_grid_thw": None,
    }


# ----------------------------------------------------------------------------- one batch


async def run_groups(
    client: AsyncRolloutClient,
    tasks: Sequence[Mapping[str, Any]],
    sizes: Sequence[int],
    sampling: Mapping[str, Any] | None = None,
    agent: Mapping[str, Any] | None = None,
    *,
    timeout: float = 3600.0,
) -> list[list[Trajectory]]:
    """Run `sizes[i]` samples of `tasks[i]` as rollserve groups; their trajectories per task,
    in sample order. Tasks of one group size go in one batch. After `timeout` seconds (or
    when the caller is cancelled) the batches are cancelled; jobs that had not finished are
    returned as they stand."""
    by_size: dict[int, list[int]] = {}
    for index, size in enumerate(sizes):
        by_size.setdefault(size, []).append(index)
    out: list[list[Trajectory | None]] = [[None] * size for size in sizes]
    where: dict[str, tuple[int, int]] = {}
    batches: list[str] = []
    for size, indexes in by_size.items():
        accepted = await client.submit_batch(
            [tasks[i] for i in indexes], group_size=size, sampling=sampling, agent=agent
        )
        batches.append(accepted.batch_id)
        for n, job_id in enumerate(accepted.jobs):
            where[job_id] = (indexes[n // size], n % size)

    async def collect(batch_id: str) -> None:
        async for trajectory in client.iter_batch_results(batch_id):
            place = where.get(trajectory.job_id)
            if place is not None:
                out[place[0]][place[1]] = trajectory

    try:
        await asyncio.wait_for(asyncio.gather(*(collect(b) for b in batches)), timeout)
    except TimeoutError:
        logger.warning("rollserve batches %s unfinished after %.0f s; cancelling", batches, timeout)
        for batch_id in batches:
            await client.cancel_batch(batch_id)
    except asyncio.CancelledError:
        await asyncio.shield(_cancel_quietly(client, batches))
        raise
    for job_id, (task, sample) in where.items():
        if out[task][sample] is None:
            out[task][sample] = await client.get_rollout(job_id)
    return [[t for t in row if t is not None] for row in out]


async def _cancel_quietly(client: AsyncRolloutClient, batches: Sequence[str]) -> None:
    for batch_id in batches:
        try:
            await client.cancel_batch(batch_id)
        except Exception:  # the caller is being cancelled: nothing to report it to
            logger.warning("batch %s: could not cancel it", batch_id, exc_info=True)


# ----------------------------------------------------------------------------- the generator


class StandaloneGeneratorInterface(ABC):
    """Stands in for SkyRL's `GeneratorInterface` when SkyRL is not installed."""

    @abstractmethod
    async def generate(self, input_batch: Any) -> Any:
        raise NotImplementedError


class RollserveGeneratorMixin:
    """The rollserve half of `RollserveGenerator`; the other half is SkyRL's
    `GeneratorInterface` (or `StandaloneGeneratorInterface`).

    `url` (else `$ROLLSERVE_URL`), `token` (else `$ROLLSERVE_API_TOKEN`); `data_source_map`
    (SkyRL `env_class` → rollserve handler); `max_turns` and `max_total_tokens` (rollserve's
    `agent` limits; the service defaults when None); `max_response_tokens` (cut longer
    responses); `timeout` (seconds per `generate`, then unfinished jobs are cancelled);
    `mask_failed_groups`, `zero_reward_on_non_stop`, `apply_overlong_filtering` (see
    `generator_output`); `step_wise`: SkyRL's `generator.step_wise_trajectories`, so every
    segment of a job is a row of its own (see the module docstring)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        data_source_map: Mapping[str, str] | None = None,
        max_turns: int | None = None,
        max_total_tokens: int | None = None,
        max_response_tokens: int | None = None,
        timeout: float = 3600.0,
        request_timeout: float = 60.0,
        mask_failed_groups: bool = True,
        zero_reward_on_non_stop: bool = False,
        apply_overlong_filtering: bool = False,
        step_wise: bool = False,
    ) -> None:
        super().__init__()
        self.url = url
        self.token = token
        self.data_source_map = dict(data_source_map or {})
        self.agent: dict[str, Any] = {}
        if max_turns is not None:
            self.agent["max_turns"] = int(max_turns)
        if max_total_tokens is not None:
            self.agent["max_total_tokens"] = int(max_total_tokens)
        self.max_response_tokens = max_response_tokens
        self.timeout = float(timeout)
        self.request_timeout = float(request_timeout)
        self.mask_failed_groups = mask_failed_groups
        self.zero_reward_on_non_stop = zero_reward_on_non_stop
        self.apply_overlong_filtering = apply_overlong_filtering
        self.step_wise = step_wise

    def tasks_and_groups(
        self, input_batch: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The rollserve task of each group of rows, and the rows of each group."""
        prompts = list(input_batch["prompts"])
        env_classes = list(input_batch.get("env_classes") or [None] * len(prompts))
        extras = list(input_batch.get("env_extras") or [{}] * len(prompts))
        ids = input_batch.get("trajectory_ids")
        groups = row_groups(
            ids,
            [(repr(p), c, repr(e)) for p, c, e in zip(prompts, env_classes, extras, strict=True)],
        )
        tasks = []
        for group in groups:
            first = group[0]
            uid = getattr(ids[first], "instance_id", None) if ids is not None else None
            tasks.append(
                task_from_env_row(
                    prompts[first], env_classes[first], extras[first], uid, self.data_source_map
                )
            )
        return tasks, groups

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        """SkyRL's `GeneratorInterface.generate`: one `GeneratorOutput` row per input row (per
        segment with `step_wise`)."""
        tasks, groups = self.tasks_and_groups(input_batch)
        params = input_batch.get("sampling_params")
        async with AsyncRolloutClient(self.url, self.token, timeout=self.request_timeout) as client:
            results = await run_groups(
                client,
                tasks,
                [len(g) for g in groups],
                sampling_from_skyrl(params),
                self.agent or None,
                timeout=self.timeout,
            )
        rows: list[Trajectory | None] = [None] * len(input_batch["prompts"])
        for group, trajectories in zip(groups, results, strict=True):
            for row, trajectory in zip(group, trajectories, strict=True):
                rows[row] = trajectory
        if any(r is None for r in rows):
            raise RuntimeError("rollserve returned fewer trajectories than rows")
        return generator_output(
            [r for r in rows if r is not None],
            trajectory_ids=input_batch.get("trajectory_ids"),
            groups=groups,
            with_logprobs=wants_logprobs(params),
            mask_failed_groups=self.mask_failed_groups,
            max_response_tokens=self.max_response_tokens,
            zero_reward_on_non_stop=self.zero_reward_on_non_stop,
            apply_overlong_filtering=self.apply_overlong_filtering,
            step_wise=self.step_wise,
        )


def skyrl_base_module() -> str | None:
    """The module of the installed SkyRL's `GeneratorInterface`, or None."""
    if importlib.util.find_spec("skyrl") is not None:
        return "skyrl.train.generators.base"
    if importlib.util.find_spec("skyrl_train") is not None:
        return "skyrl_train.generators.base"
    return None


def _build_generator() -> type[Any]:
    base: type[Any] = StandaloneGeneratorInterface
    module = skyrl_base_module()
    if module is not None:
        base = importlib.import_module(module).GeneratorInterface

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(
            __module__=__name__,
            __qualname__="RollserveGenerator",
            __doc__=RollserveGeneratorMixin.__doc__,
        )

    return types.new_class("RollserveGenerator", (RollserveGeneratorMixin, base), exec_body=body)


def __getattr__(name: str) -> Any:
    if name == "RollserveGenerator":
        cls = _build_generator()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GENERATOR_INPUT_KEYS",
    "GENERATOR_OUTPUT_KEYS",
    "RollserveGeneratorMixin",
    "StandaloneGeneratorInterface",
    "generator_output",
    "row_groups",
    "run_groups",
    "sampling_from_skyrl",
    "task_from_env_row",
]
