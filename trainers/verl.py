"""veRL adapter: `RollserveAgentLoop`, an `AgentLoopBase` whose episodes run in rollserve.

veRL's `AgentLoopWorker` builds one agent loop per sample (`hydra.utils.instantiate` of the
registry entry, with `trainer_config`, `server_manager`, `tokenizer`, ...) and awaits
`run(sampling_params, **kwargs)`, where `kwargs` are the dataset row's fields (`raw_prompt`,
`data_source`, `reward_model`, `extra_info`, `index`, ...). `RollserveAgentLoop.run` turns the
row into a rollserve task, submits it (`POST /v1/rollouts`), waits for the trajectory and
returns an `AgentLoopOutput`: rollserve's `prompt_ids`, its `response_ids` cut to veRL's
`rollout.response_length`, `response_mask` from the loss mask, `response_logprobs` (0.0 where
the mask is 0), `reward_score` from rollserve's EVAL and `num_turns` counted as veRL's own
tool loop counts them (model turns + environment turns + 1). veRL's `server_manager` is not
used: rollserve's backends generate.

A trajectory of several segments (a harness edited or summarised its history, so a model call's
prompt did not extend the sequence before it: `core.schemas.Segment`) is several training
samples: `run` returns one `AgentLoopOutput` per segment, in order, each with its own prompt,
response, mask and logprobs and every one with the job's reward. veRL's V1 trainer
(`trainer.use_v1`, the default since 0.9) takes such a list from an agent loop
(`AgentLoopWorkerTQ._agent_loop_postprocess`) and, for GRPO, computes the advantage from each
session's last output and gives it to the session's other outputs
(`compute_advantage_for_multi_trajectories`): the segments of one job share the job's advantage
and the job counts once in its group's mean and spread. The legacy V0 worker takes one output
per sample: with `trainer.use_v1: false` only the first segment is returned (with a warning).
A one-segment trajectory is one output, as before.

Field names were read from verl-project/verl at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22),
`verl/experimental/agent_loop/agent_loop.py` (`AgentLoopBase`, `AgentLoopOutput`,
`AgentLoopMetrics`, `register`, `AgentLoopWorker._run_agent_loop` and
`_agent_loop_postprocess`) and `single_turn_agent_loop.py` / `tool_agent_loop.py` (truncation
to `response_length`, `num_turns`, the `turn_scores`/`tool_rewards` extra fields), and checked
against the released `verl==0.9.1` wheel.

veRL is imported only when `RollserveAgentLoop` is first looked up (PEP 562 module
`__getattr__`): with veRL installed the class subclasses its `AgentLoopBase` and is registered
as `rollserve_agent`; without it, it subclasses `StandaloneAgentLoopBase` and returns
`StandaloneAgentLoopOutput` (same field names), so it runs and is tested without veRL. Plug it
in with `actor_rollout_ref.rollout.agent.agent_loop_config_path` pointing at::

    - name: rollserve_agent
      _target_: trainers.verl.RollserveAgentLoop
      rollserve_url: http://rollserve-gateway:8600

and `agent_name: rollserve_agent` in the dataset rows (or as `default_agent_loop`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.client import AsyncRolloutClient
from core.flatten import segments_and_turns
from core.schemas import EnvTurn, JobStatus, ModelTurn, Segment, Trajectory

logger = logging.getLogger(__name__)

AGENT_NAME = "rollserve_agent"
"""The name `RollserveAgentLoop` is registered under in veRL's agent loop registry."""

AGENT_LOOP_OUTPUT_FIELDS = (
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
)
"""The fields of veRL's `AgentLoopOutput` this adapter fills (the others — `routed_experts`,
`multi_modal_data`, `mm_processor_kwargs` — keep their defaults)."""

AGENT_LOOP_METRICS_FIELDS = ("generate_sequences", "tool_calls", "compute_score", "num_preempted")
"""veRL's `AgentLoopMetrics`: seconds generating, in tools, scoring; preemptions (-1: unknown)."""

TASK_KEY = "rollserve_task"
"""A dataset column (or `extra_info` key) holding the whole rollserve task."""

FAILED = frozenset({JobStatus.failed, JobStatus.cancelled, JobStatus.timed_out})

OnFailure = Literal["mask", "raise"]


# ----------------------------------------------------------------------------- rows → tasks


def plain(value: Any) -> Any:
    """`value` as plain JSON data: numpy scalars and arrays (veRL keeps dataset columns in
    object arrays) become Python numbers and lists, mappings dicts, tuples lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, str | bytes | bool | int | float) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return plain(value.tolist())
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def last_user_text(messages: Any) -> str | None:
    """The text of the last `user` message of a chat (`content` a string, or a list of parts
    whose `text` parts are joined), or None."""
    for message in reversed(plain(messages) or []):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
            return "".join(str(p) for p in parts)
    return None


def explicit_task(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rollserve task a row carries whole: its `rollserve_task` column, or
    `extra_info.rollserve_task`; None when it has neither."""
    task = row.get(TASK_KEY)
    if task is None:
        extra = row.get("extra_info")
        if isinstance(extra, Mapping):
            task = extra.get(TASK_KEY)
    if task is None:
        return None
    task = plain(task)
    if not isinstance(task, dict) or not task.get("data_source"):
        raise ValueError(f"{TASK_KEY} must be an object with a data_source, not {task!r}")
    return task


def simple_task(
    data_source: str, messages: Any, ground_truth: Any, instance_id: Any = None
) -> dict[str, Any]:
    """A question/answer task (rollserve's `math` and `stem` handlers read `question` and
    `answer`) from a chat prompt's last user message and the row's ground truth."""
    question = last_user_text(messages)
    if not question:
        raise ValueError("the row's prompt has no user message to use as the question")
    if ground_truth is None:
        raise ValueError(f"the row has no ground truth and no {TASK_KEY}")
    task: dict[str, Any] = {
        "data_source": data_source,
        "question": question,
        "answer": plain(ground_truth),
    }
    if instance_id is not None and str(instance_id) != "":
        task["instance_id"] = str(plain(instance_id))
    return task


def task_from_row(
    row: Mapping[str, Any], data_source_map: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The rollserve task for one veRL dataset row (the `kwargs` of `AgentLoopBase.run`).

    A row's `rollserve_task` (a column, or a key of `extra_info`) is used as it is. Otherwise
    the row is read as veRL's own preprocessed datasets lay it out (`data_source`, `prompt` →
    `raw_prompt`, `reward_model.ground_truth`, `extra_info.index`): the handler is
    `data_source_map[data_source]` (the row's `data_source` itself when unmapped), the question
    the last user message, the answer the ground truth, the instance id the index."""
    task = explicit_task(row)
    if task is not None:
        return task
    source = plain(row.get("data_source"))
    if not source:
        raise ValueError(f"the row has neither a {TASK_KEY} nor a data_source")
    mapped = (data_source_map or {}).get(str(source), str(source))
    reward_model = plain(row.get("reward_model")) or {}
    extra = plain(row.get("extra_info")) or {}
    index = extra.get("index") if isinstance(extra, dict) else None
    if index is None:
        index = plain(row.get("index"))
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return simple_task(mapped, row.get("raw_prompt", row.get("prompt")), ground_truth, index)


# ----------------------------------------------------------------------------- parameters


def sampling_from_verl(
    sampling_params: Mapping[str, Any], response_length: int | None = None
) -> dict[str, Any]:
    """rollserve `sampling` from veRL's (`temperature`, `top_p`, `top_k`,
    `repetition_penalty`, `logprobs`): temperature and top_p pass through; each model call may
    generate up to `response_length` ids. rollserve samples without top-k and without a
    repetition penalty: values other than veRL's neutral ones are logged and not applied."""
    sampling: dict[str, Any] = {}
    if sampling_params.get("temperature") is not None:
        sampling["temperature"] = float(sampling_params["temperature"])
    if sampling_params.get("top_p") is not None:
        sampling["top_p"] = float(sampling_params["top_p"])
    if response_length:
        sampling["max_tokens"] = int(response_length)
    top_k = sampling_params.get("top_k")
    if top_k is not None and int(top_k) not in (-1, 0):
        logger.warning("rollserve samples without top-k: top_k=%s is not applied", top_k)
    penalty = sampling_params.get("repetition_penalty")
    if penalty is not None and float(penalty) != 1.0:
        logger.warning("rollserve has no repetition penalty: %s is not applied", penalty)
    return sampling


def agent_from_verl(response_length: int | None, max_turns: int | None) -> dict[str, Any]:
    """rollserve `agent` limits: the job's response ids (generated and observations) are
    capped at veRL's `response_length`, exactly what veRL keeps; `max_turns` model calls."""
    agent: dict[str, Any] = {}
    if response_length:
        agent["max_total_tokens"] = int(response_length)
    if max_turns:
        agent["max_turns"] = int(max_turns)
    return agent


# ----------------------------------------------------------------------------- trajectory → output


def failed(trajectory: Trajectory) -> bool:
    """True for a job that ended without a grade (failed, cancelled, timed out, no reward)."""
    return trajectory.status in FAILED or trajectory.reward is None


def agent_loop_metrics(trajectory: Trajectory) -> dict[str, float | int]:
    """veRL's `AgentLoopMetrics` from rollserve's timing: model seconds, tool seconds, grading
    seconds; preemptions unknown (-1)."""
    timing = trajectory.timing
    return {
        "generate_sequences": float(timing.llm),
        "tool_calls": float(timing.tools),
        "compute_score": float(timing.eval or 0.0),
        "num_preempted": -1,
    }


def agent_loop_outputs(
    trajectory: Trajectory,
    *,
    response_length: int | None = None,
    prompt_length: int | None = None,
    with_logprobs: bool = True,
    mask_failed: bool = True,
) -> list[dict[str, Any]]:
    """The keyword arguments of veRL's `AgentLoopOutput`, one set per segment of the
    trajectory, in order (one for a one-segment trajectory).

    Each segment's `response_ids`, `response_mask` (rollserve's loss mask) and
    `response_logprobs` (0.0 where the mask is 0, as veRL pads them) are cut to
    `response_length`; a prompt longer than `prompt_length` keeps its last ids, as
    `AgentLoopBase._cap_text_prompt_length` does. Every segment gets the job's reward. A job
    that did not complete keeps what it generated but gets all-zero masks and reward 0.0
    (`mask_failed`), so it adds no gradient and never fails the step. With more than one
    segment, each output's extra fields also say which segment it is (`rollserve_segment`,
    `rollserve_segments`, `rollserve_segment_reason`) and carry an empty `reward_extra_info`,
    which veRL's V1 worker copies from the last output to the others."""
    parts = segments_and_turns(trajectory)
    outputs = [
        _segment_fields(
            trajectory,
            part,
            turns,
            last=index == len(parts) - 1,
            response_length=response_length,
            prompt_length=prompt_length,
            with_logprobs=with_logprobs,
            mask_failed=mask_failed,
        )
        for index, (part, turns) in enumerate(parts)
    ]
    if len(outputs) > 1:
        for index, (fields, (part, _)) in enumerate(zip(outputs, parts, strict=True)):
            fields["extra_fields"].update(
                rollserve_segment=index,
                rollserve_segments=len(parts),
                rollserve_segment_reason=part.reason,
                reward_extra_info={},
            )
    return outputs


def agent_loop_fields(
    trajectory: Trajectory,
    *,
    response_length: int | None = None,
    prompt_length: int | None = None,
    with_logprobs: bool = True,
    mask_failed: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of veRL's `AgentLoopOutput` for the trajectory's first segment
    (the whole trajectory when it is one sequence): see `agent_loop_outputs`."""
    return agent_loop_outputs(
        trajectory,
        response_length=response_length,
        prompt_length=prompt_length,
        with_logprobs=with_logprobs,
        mask_failed=mask_failed,
    )[0]


def _segment_fields(
    trajectory: Trajectory,
    segment: Segment,
    turns: Sequence[ModelTurn | EnvTurn],
    *,
    last: bool,
    response_length: int | None,
    prompt_length: int | None,
    with_logprobs: bool,
    mask_failed: bool,
) -> dict[str, Any]:
    """One segment as `AgentLoopOutput`'s keyword arguments (`last`: the job's last segment,
    the one its truncation cut)."""
    prompt_ids = list(segment.prompt_ids)
    if prompt_length is not None and len(prompt_ids) > prompt_length:
        logger.warning(
            "job %s: prompt of %d ids exceeds rollout.prompt_length=%d; left-truncating",
            trajectory.job_id,
            len(prompt_ids),
            prompt_length,
        )
        prompt_ids = prompt_ids[-prompt_length:] if prompt_length > 0 else []
    response_ids = list(segment.response_ids)
    mask = [int(m) for m in segment.loss_mask]
    if len(mask) != len(response_ids):
        raise ValueError(
            f"job {trajectory.job_id}: loss_mask has {len(mask)} ids, response {len(response_ids)}"
        )
    logprobs: list[float] | None = None
    if with_logprobs:
        if len(segment.logprobs) != len(response_ids):
            raise ValueError(f"job {trajectory.job_id}: logprobs are not aligned with the response")
        logprobs = [0.0 if lp is None else float(lp) for lp in segment.logprobs]
    cut = response_length is not None and len(response_ids) > response_length
    if response_length is not None:
        response_ids = response_ids[:response_length]
        mask = mask[:response_length]
        logprobs = None if logprobs is None else logprobs[:response_length]
    is_failed = failed(trajectory)
    reward = 0.0 if trajectory.reward is None else float(trajectory.reward)
    if is_failed and mask_failed:
        mask = [0] * len(mask)
        reward = 0.0
    model_turns = sum(isinstance(t, ModelTurn) for t in turns)
    env_turns = sum(isinstance(t, EnvTurn) for t in turns)
    return {
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "response_mask": mask,
        "response_logprobs": logprobs,
        "reward_score": reward,
        "num_turns": model_turns + env_turns + 1,
        "metrics": agent_loop_metrics(trajectory),
        "extra_fields": {
            "turn_scores": [],
            "tool_rewards": [],
            "rollserve_job_id": trajectory.job_id,
            "rollserve_status": str(trajectory.status),
            "rollserve_stop_reason": trajectory.stop_reason,
            "rollserve_truncated": bool((trajectory.truncated and last) or cut),
            "rollserve_policy_versions": [
                t.policy_version for t in turns if isinstance(t, ModelTurn)
            ],
            "rollserve_error": None if trajectory.error is None else trajectory.error.model_dump(),
        },
    }


# ----------------------------------------------------------------------------- one rollout


async def run_rollout(
    client: AsyncRolloutClient,
    task: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    agent: Mapping[str, Any] | None = None,
    *,
    timeout: float = 3600.0,
    wait_chunk: float = 300.0,
    poll: float = 1.0,
) -> Trajectory:
    """Submit one job and return its finished trajectory.

    The gateway holds the submission up to `wait_chunk` seconds; a job still running then is
    polled (`poll` seconds, doubling up to 5). After `timeout` seconds, or when the caller is
    cancelled, the job is cancelled and what it has is returned (or the cancellation raised)."""
    deadline = time.monotonic() + timeout
    first = await client.submit_rollout(
        task, sampling, agent, wait=True, timeout=max(1.0, min(wait_chunk, timeout))
    )
    if isinstance(first, Trajectory) and first.status.terminal:
        return first
    job_id = first if isinstance(first, str) else first.job_id
    pause = poll
    try:
        while True:
            trajectory = await client.get_rollout(job_id)
            if trajectory.status.terminal:
                return trajectory
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("job %s: no result within %.0f s; cancelling it", job_id, timeout)
                return await client.cancel_rollout(job_id)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 5.0)
    except asyncio.CancelledError:
        await asyncio.shield(_cancel_quietly(client, job_id))
        raise


async def _cancel_quietly(client: AsyncRolloutClient, job_id: str) -> None:
    try:
        await client.cancel_rollout(job_id)
    except Exception:  # the caller is being cancelled: nothing to report it to
        logger.warning("job %s: could not cancel it", job_id, exc_info=True)


# ----------------------------------------------------------------------------- the agent loop


def _get(config: Any, *path: str) -> Any:
    """`config.a.b.c` on an OmegaConf config, a namespace or a dict; None where absent."""
    for key in path:
        if config is None:
            return None
        config = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return config


class StandaloneAgentLoopOutput(BaseModel):
    """`AgentLoopOutput`'s fields as this adapter fills them, returned when veRL is absent."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: dict[str, float | int] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)


class StandaloneAgentLoopBase:
    """Stands in for veRL's `AgentLoopBase` when veRL is not installed: takes the same
    constructor arguments and keeps `config` and `rollout_config` the same way."""

    def __init__(
        self,
        trainer_config: Any = None,
        server_manager: Any = None,
        tokenizer: Any = None,
        processor: Any = None,
        dataset_cls: Any = None,
        data_config: Any = None,
        **kwargs: Any,
    ) -> None:
        self.config = getattr(trainer_config, "config", trainer_config)
        self.rollout_config = _get(self.config, "actor_rollout_ref", "rollout")
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = getattr(data_config, "config", data_config)


class RollserveAgentLoopMixin:
    """The rollserve half of `RollserveAgentLoop`; the other half is veRL's `AgentLoopBase`
    (or `StandaloneAgentLoopBase`).

    Keyword arguments (the extra keys of the agent loop's config entry): `rollserve_url`
    (else `$ROLLSERVE_URL`), `rollserve_token` (else `$ROLLSERVE_API_TOKEN`),
    `rollserve_timeout` (seconds per job, then it is cancelled), `data_source_map` (veRL
    `data_source` → rollserve handler), `max_turns` (else veRL's
    `multi_turn.max_assistant_turns`), `on_failure` (`mask`: a job that did not complete is
    returned masked with reward 0; `raise`: the step fails)."""

    config: Any
    rollout_config: Any

    def __init__(
        self,
        *args: Any,
        rollserve_url: str | None = None,
        rollserve_token: str | None = None,
        rollserve_timeout: float = 3600.0,
        request_timeout: float = 60.0,
        data_source_map: Mapping[str, str] | None = None,
        max_turns: int | None = None,
        on_failure: OnFailure = "mask",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if on_failure not in ("mask", "raise"):
            raise ValueError(f"on_failure must be 'mask' or 'raise', not {on_failure!r}")
        self.rollserve_url = rollserve_url
        self.rollserve_token = rollserve_token
        self.rollserve_timeout = float(rollserve_timeout)
        self.request_timeout = float(request_timeout)
        self.data_source_map = dict(plain(data_source_map) or {})
        self.max_turns = max_turns
        self.on_failure: OnFailure = on_failure

    def rollout_limits(self) -> tuple[int | None, int | None, int | None]:
        """veRL's `rollout.response_length`, `rollout.prompt_length` and the model turns
        (`max_turns`, else `rollout.multi_turn.max_assistant_turns`)."""
        config = self.rollout_config
        response_length = _get(config, "response_length")
        prompt_length = _get(config, "prompt_length")
        turns = self.max_turns or _get(config, "multi_turn", "max_assistant_turns")
        return (
            None if response_length is None else int(response_length),
            None if prompt_length is None else int(prompt_length),
            None if turns is None else int(turns),
        )

    async def run_trajectory(self, sampling_params: Mapping[str, Any], **kwargs: Any) -> Trajectory:
        """The finished rollserve trajectory for one dataset row."""
        response_length, _, max_turns = self.rollout_limits()
        task = task_from_row(kwargs, self.data_source_map)
        sampling = sampling_from_verl(sampling_params, response_length)
        agent = agent_from_verl(response_length, max_turns)
        async with AsyncRolloutClient(
            self.rollserve_url, self.rollserve_token, timeout=self.request_timeout
        ) as client:
            return await run_rollout(client, task, sampling, agent, timeout=self.rollserve_timeout)

    def takes_several_outputs(self) -> bool:
        """Whether the trainer takes a list of outputs from one agent loop: veRL's V1 trainer
        does (`trainer.use_v1`, true unless the config says otherwise), the legacy one not."""
        use_v1 = _get(self.config, "trainer", "use_v1")
        return use_v1 is None or bool(use_v1)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """veRL's `AgentLoopBase.run`: one dataset row → one `AgentLoopOutput`, or a list of
        them, one per segment, for a trajectory of several segments (module docstring)."""
        trajectory = await self.run_trajectory(sampling_params, **kwargs)
        if failed(trajectory) and self.on_failure == "raise":
            error = trajectory.error
            raise RuntimeError(
                f"rollserve job {trajectory.job_id} ended {trajectory.status}"
                + (f" in {error.stage}: {error.type}: {error.message}" if error else "")
            )
        response_length, prompt_length, _ = self.rollout_limits()
        outputs = agent_loop_outputs(
            trajectory,
            response_length=response_length,
            prompt_length=prompt_length,
            with_logprobs=bool(sampling_params.get("logprobs", True)),
        )
        output = output_class()
        if len(outputs) == 1:
            return output(**outputs[0])
        if not self.takes_several_outputs():
            logger.warning(
                "job %s has %d segments but veRL's legacy trainer (trainer.use_v1=false) takes "
                "one output per sample: only the first segment is trained",
                trajectory.job_id,
                len(outputs),
            )
            return output(**outputs[0])
        return [output(**fields) for fields in outputs]


def verl_available() -> bool:
    """Whether veRL is installed (its agent loop module is then imported on first use)."""
    return importlib.util.find_spec("verl") is not None


def output_class() -> type[Any]:
    """veRL's `AgentLoopOutput`, or `StandaloneAgentLoopOutput` without veRL."""
    if verl_available():
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        return AgentLoopOutput
    return StandaloneAgentLoopOutput


def _body(namespace: dict[str, Any]) -> None:
    namespace.update(
        __module__=__name__,
        __qualname__="RollserveAgentLoop",
        __doc__=RollserveAgentLoopMixin.__doc__,
    )


def _build_agent_loop() -> type[Any]:
    """`RollserveAgentLoop` over veRL's `AgentLoopBase` (registered as `rollserve_agent`), or
    over `StandaloneAgentLoopBase` without veRL."""
    base: type[Any] = StandaloneAgentLoopBase
    register: Any = None
    if verl_available():
        from verl.experimental.agent_loop.agent_loop import AgentLoopBase
        from verl.experimental.agent_loop.agent_loop import register as verl_register

        base, register = AgentLoopBase, verl_register
    cls = types.new_class("RollserveAgentLoop", (RollserveAgentLoopMixin, base), exec_body=_body)
    return register(AGENT_NAME)(cls) if register is not None else cls


def __getattr__(name: str) -> Any:
    if name == "RollserveAgentLoop":
        cls = _build_agent_loop()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AGENT_LOOP_METRICS_FIELDS",
    "AGENT_LOOP_OUTPUT_FIELDS",
    "AGENT_NAME",
    "RollserveAgentLoopMixin",
    "StandaloneAgentLoopBase",
    "StandaloneAgentLoopOutput",
    "agent_from_verl",
    "agent_loop_fields",
    "agent_loop_outputs",
    "run_rollout",
    "sampling_from_verl",
    "task_from_row",
]
