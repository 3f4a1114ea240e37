"""TRL's `GRPOTrainer` with its rollouts from rollserve: a `rollout_func` and a reward function.

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trainers.trl import problem_text, rollserve_reward, rollserve_rollout_func, tasks_by_prompt

    tasks = [...]                                     # rollserve tasks (`data_source`, ...)
    dataset = Dataset.from_list([{"prompt": problem_text(t)} for t in tasks])
    rollout = rollserve_rollout_func("http://127.0.0.1:8600", tasks_by_prompt(tasks),
                                     sampling={"temperature": 1.0, "max_tokens": 1024})
    trainer = GRPOTrainer(model=..., args=GRPOConfig(num_generations=8, ...),
                          train_dataset=dataset, reward_funcs=rollserve_reward,
                          rollout_func=rollout)

The contract matched is TRL 1.16's (`trl/trainer/grpo_trainer.py`, `GRPOTrainer._generate`):
`rollout_func(prompts, trainer)` gets this process's slice of the generation batch, each prompt
already repeated `num_generations` times in a row by TRL's `RepeatSampler`, and returns a dict of
lists, one entry per prompt in that order: `prompt_ids`, `completion_ids` and `logprobs` (required;
a None logprob is read as NaN, "not scored"), and any other key as an extra field. `env_mask` is
taken out of the extras and used as the tool mask (1 = the model's own token): TRL multiplies it
into the completion mask for the loss and counts only its ones as completion length. Every other
extra key is handed to each reward function as a keyword argument, one value per completion.
`use_vllm` is not needed (TRL recomputes the logprobs with its own model; rollserve's go to its
off-policy mask when that is on). Give the trainer no `tools`: with tools TRL runs its own tool
loop and ignores `env_mask`; here the tools run in rollserve.

What the adapter does per call: runs of `num_generations` equal prompts become rollserve groups
(`group_size` = the run's length; one batch per call, two only when a process's slice cuts a group
short), `task_builder` turns each group's prompt into a rollserve task, and the finished
trajectories come back in TRL's order: `prompt_ids` = the trajectory's first prompt, as the service
rendered it with the model's chat template; `completion_ids` = everything after it, the model's
turns and the tool observations interleaved as the record has them; `env_mask` = rollserve's
`loss_mask`; `logprobs` = the backend's, 0.0 where the mask is 0. The reward comes as the extra
field `rollserve_reward`, which the reward function `rollserve_reward` returns as it is.

A job that did not complete (`failed`, `timed_out`, `cancelled`) is, by `on_failure`:
- `"skip"` (default): kept with what it has, its `env_mask` all zeros and its reward None, which
  TRL takes as "unscorable": left out of its group's baseline, advantage 0, no token of it in the
  loss;
- `"zero"`: kept as it is with reward 0.0 (a partial episode trained as a failure);
- `"raise"`: `RolloutFailed` for the first such job, in TRL's order.
A completion with no token at all (a job that failed before its first model call) is one padding
token with mask 0 (TRL reads the last id of every completion).

A trajectory of several segments (a harness edited or summarised its history, so a model call's
prompt did not extend the sequence before it: `core.schemas.Segment`) cannot be several samples
here: TRL wants exactly `num_generations` completions per prompt, scores them row by row and
normalises rewards over each run of `num_generations` rows (`GRPOTrainer._generate` and
`_generate_and_score_completions`), so an extra row would shift every group after it. Each job
is therefore its first segment, whose prompt is the one TRL's row stands for, with the job's
reward and advantage; its later segments are not trained (a warning counts them, and the extra
field `rollserve_segments` gives each completion's number of segments). veRL's V1 trainer and
SkyRL's step-wise mode train every segment (`trainers.verl`, `trainers.skyrl`).

The trainer's new weights reach the inference servers through the callback of
`trainers.trl_weights` (saved, then `update_weights` with the step as the policy version), or
by the training loop itself (drain, load, resume with a `policy_version`); each
completion's `rollserve_policy_version` says which weights generated it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from api.client import AgentLike, RolloutClient, SamplingLike
from core.schemas import MAX_SEED, JobStatus, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

TaskBuilder = Callable[[Any], Mapping[str, Any]]
"""TRL's prompt (a string, or a conversation: a list of `{"role", "content"}`) → a rollserve
task (`{"data_source": ..., ...}`)."""

OnFailure = Literal["skip", "zero", "raise"]

REWARD_KEY = "rollserve_reward"
JOB_KEY = "rollserve_job_id"
STATUS_KEY = "rollserve_status"
POLICY_KEY = "rollserve_policy_version"
SEGMENTS_KEY = "rollserve_segments"
"""The extra field with each completion's number of segments (1: one sequence, all trained)."""
ENV_MASK_KEY = "env_mask"
"""TRL's name of the mask of the model's own tokens in a `rollout_func`'s output."""

PROBLEM_FIELDS = ("problem", "question", "prompt", "instruction")
"""Where the handlers shipped with rollserve read a task's text (`math`, `stem`, `code`,
`shell`), in the order `problem_text` looks."""


class RolloutFailed(RuntimeError):
    """A job of a TRL batch did not complete and `on_failure` is `"raise"`."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        error = trajectory.error
        why = f": {error.stage} {error.type}: {error.message}" if error is not None else ""
        super().__init__(f"rollserve job {trajectory.job_id} ended {trajectory.status}{why}")


# ----------------------------------------------------------------------------- prompts


def prompt_text(prompt: Any) -> str:
    """The text of a TRL prompt: the string itself, or a conversation's last user message (its
    text parts joined when the content is a list of typed blocks)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            content = users[-1].get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, Sequence):
                parts = [
                    str(block.get("text", ""))
                    for block in content
                    if isinstance(block, Mapping) and block.get("type") == "text"
                ]
                return "".join(parts)
    raise TypeError(f"not a TRL prompt (a string or a list of messages): {prompt!r:.200}")


def problem_text(task: Mapping[str, Any]) -> str:
    """A rollserve task's problem text, the first of `PROBLEM_FIELDS` it has: what to put in the
    TRL dataset's `prompt` column for `tasks_by_prompt` to find the task again."""
    for name in PROBLEM_FIELDS:
        value = task.get(name)
        if isinstance(value, str) and value:
            return value
    raise KeyError(f"task {task.get('instance_id')!r} has none of the fields {PROBLEM_FIELDS}")


def tasks_by_prompt(
    tasks: Iterable[Mapping[str, Any]],
    prompt_of: Callable[[Mapping[str, Any]], str] = problem_text,
) -> TaskBuilder:
    """A task builder that finds, for TRL's prompt, the task whose `prompt_of(task)` is the
    prompt's text (`prompt_text`). Two different tasks with the same text are refused here;
    an unknown prompt raises KeyError when it comes."""
    table: dict[str, dict[str, Any]] = {}
    for task in tasks:
        key = prompt_of(task)
        if key in table and table[key] != dict(task):
            raise ValueError(f"two different tasks have the prompt {key[:80]!r}")
        table[key] = dict(task)

    def build(prompt: Any) -> Mapping[str, Any]:
        text = prompt_text(prompt)
        try:
            return table[text]
        except KeyError:
            raise KeyError(f"no rollserve task has the prompt {text[:80]!r}") from None

    return build


@dataclass(frozen=True)
class Group:
    """Prompts `start` .. `start + size - 1` of TRL's list: one rollserve group."""

    start: int
    size: int


def plan_groups(prompts: Sequence[Any], group_size: int | None) -> list[Group]:
    """TRL's prompts as groups: each run of equal consecutive prompts, cut into pieces of
    `group_size` (the last piece shorter when a run is not a multiple of it)."""
    groups: list[Group] = []
    start = 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and prompts[end] == prompts[start]:
            end += 1
        step = group_size if group_size and group_size > 0 else end - start
        for piece in range(start, end, step):
            groups.append(Group(piece, min(step, end - piece)))
        start = end
    return groups


# ----------------------------------------------------------------------------- results


@dataclass
class Completion:
    """One entry of TRL's output lists."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None]
    env_mask: list[int]
    reward: float | None


def completion_of(trajectory: Trajectory, pad_id: int, on_failure: OnFailure) -> Completion:
    """One trajectory as TRL wants it: its first segment (see the module's docstring for
    failed jobs and for later segments)."""
    record = (trajectory.response_ids, trajectory.loss_mask, trajectory.logprobs)
    if len({len(part) for part in record}) != 1:
        raise ValueError(
            f"trajectory {trajectory.job_id}: response_ids, loss_mask and logprobs differ in "
            f"length ({', '.join(str(len(part)) for part in record)})"
        )
    completed = trajectory.status == JobStatus.completed
    if not completed and on_failure == "raise":
        raise RolloutFailed(trajectory)
    reward = trajectory.reward if completed else (0.0 if on_failure == "zero" else None)
    ids = list(trajectory.response_ids)
    mask = [1 if m else 0 for m in trajectory.loss_mask]
    if not completed and on_failure == "skip":
        mask = [0] * len(ids)
    logprobs: list[float | None] = [
        lp if m else 0.0 for m, lp in zip(trajectory.loss_mask, trajectory.logprobs, strict=True)
    ]
    if not ids:
        ids, mask, logprobs = [pad_id], [0], [0.0]
    return Completion(list(trajectory.prompt_ids) or [pad_id], ids, logprobs, mask, reward)


def trl_output(
    trajectories: Sequence[Trajectory], pad_id: int, on_failure: OnFailure = "skip"
) -> dict[str, list[Any]]:
    """The dict a TRL `rollout_func` returns, from trajectories in TRL's order."""
    rows = [completion_of(t, pad_id, on_failure) for t in trajectories]
    later = sum(len(t.segments) for t in trajectories)
    if later:
        logger.warning(
            "%d later segment(s) of %d job(s) not trained: TRL takes one completion per "
            "prompt, so each job is its first segment",
            later,
            sum(1 for t in trajectories if t.segments),
        )
    return {
        "prompt_ids": [r.prompt_ids for r in rows],
        "completion_ids": [r.completion_ids for r in rows],
        "logprobs": [r.logprobs for r in rows],
        ENV_MASK_KEY: [r.env_mask for r in rows],
        REWARD_KEY: [r.reward for r in rows],
        JOB_KEY: [t.job_id for t in trajectories],
        STATUS_KEY: [str(t.status) for t in trajectories],
        POLICY_KEY: [t.policy_version for t in trajectories],
        SEGMENTS_KEY: [1 + len(t.segments) for t in trajectories],
    }


def _pad_id(trainer: Any) -> int:
    """The trainer's padding id (its end-of-sequence id without one; 0 without either)."""
    processing = getattr(trainer, "processing_class", None)
    tokenizer = getattr(processing, "tokenizer", processing)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _group_size(trainer: Any) -> int | None:
    """How many completions TRL wants per prompt now (training or evaluation)."""
    model = getattr(trainer, "model", None)
    training = bool(getattr(model, "training", True))
    size = getattr(trainer, "num_generations" if training else "num_generations_eval", None)
    size = size or getattr(trainer, "num_generations", None)
    return size if isinstance(size, int) else None


# ----------------------------------------------------------------------------- the adapter


class RollserveRollout:
    """A TRL `rollout_func` (call it as `rollout(prompts, trainer)`) backed by a rollserve
    gateway. Build it with `rollserve_rollout_func`."""

    def __init__(
        self,
        client: RolloutClient | str | None,
        task_builder: TaskBuilder,
        *,
        data_source: str | None = None,
        sampling: SamplingLike = None,
        agent: AgentLike = None,
        on_failure: OnFailure = "skip",
        on_batch: Callable[[list[Trajectory]], None] | None = None,
        token: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        if on_failure not in get_args(OnFailure):
            raise ValueError(f"on_failure must be one of {get_args(OnFailure)}, not {on_failure!r}")
        self._owns_client = client is None or isinstance(client, str)
        self.client = (
            RolloutClient(client, token, timeout)
            if client is None or isinstance(client, str)
            else client
        )
        self.task_builder = task_builder
        self.data_source = data_source
        self.sampling = None if sampling is None else _as_dict(sampling)
        self.agent = agent
        self.on_failure: OnFailure = on_failure
        self.on_batch = on_batch
        self.last: list[Trajectory] = []
        """The trajectories of the last call, in TRL's order."""
        self.calls = 0
        self._seed_offset = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        trajectories = self.rollout(prompts, _group_size(trainer))
        return trl_output(trajectories, _pad_id(trainer), self.on_failure)

    def rollout(self, prompts: Sequence[Any], group_size: int | None = None) -> list[Trajectory]:
        """Run one finished trajectory per prompt (equal consecutive prompts as groups of
        `group_size`) and return them in the prompts' order."""
        groups = plan_groups(prompts, group_size)
        by_size: dict[int, list[Group]] = {}
        for group in groups:
            by_size.setdefault(group.size, []).append(group)
        batches: list[tuple[str, list[str], int, list[Group]]] = []
        try:
            for size, members in by_size.items():
                tasks = [self._task(prompts[g.start]) for g in members]
                accepted = self.client.submit_batch(
                    tasks, group_size=size, sampling=self._sampling(size), agent=self.agent
                )
                batches.append((accepted.batch_id, accepted.jobs, size, members))
            found: list[Trajectory | None] = [None] * len(prompts)
            for batch_id, jobs, size, members in batches:
                place = {job: members[i // size].start + i % size for i, job in enumerate(jobs)}
                for trajectory in self._results(batch_id, jobs):
                    found[place[trajectory.job_id]] = trajectory
        except BaseException:
            for batch_id, *_ in batches:
                # The error that stopped the call matters more than one cancelling it.
                with contextlib.suppress(Exception):
                    self.client.cancel_batch(batch_id)
            raise
        self.calls += 1
        self.last = [t for t in found if t is not None]
        if len(self.last) != len(prompts):  # pragma: no cover - every job has a place
            raise RuntimeError("a rollserve batch answered fewer trajectories than it has jobs")
        if self.on_batch is not None:
            self.on_batch(list(self.last))
        return self.last

    def close(self) -> None:
        """Close the client, when this adapter made it."""
        if self._owns_client:
            self.client.close()

    def _task(self, prompt: Any) -> dict[str, Any]:
        task = dict(self.task_builder(prompt))
        if self.data_source is not None:
            task.setdefault("data_source", self.data_source)
        return task

    def _sampling(self, group_size: int) -> dict[str, Any] | None:
        """The sampling of the next batch: with a seed, each batch starts where the previous
        one's groups ended, so a prompt drawn again later gets new samples, reproducibly."""
        base = None if self.sampling is None else self.sampling.get("seed")
        if self.sampling is None or not isinstance(base, int):
            return self.sampling
        seed = (base + self._seed_offset) % (MAX_SEED - group_size + 1)
        self._seed_offset += group_size
        return {**self.sampling, "seed": seed}

    def _results(self, batch_id: str, jobs: Sequence[str]) -> list[Trajectory]:
        """Every job's final trajectory: the results stream until it ends, then each job it
        did not carry asked for on its own."""
        wanted = set(jobs)
        got: dict[str, Trajectory] = {}
        for trajectory in self.client.iter_batch_results(batch_id):
            if trajectory.job_id in wanted:
                got[trajectory.job_id] = trajectory
            if len(got) == len(wanted):
                break
        for job in jobs:
            if job not in got:
                got[job] = self.client.get_rollout(job)
        return [got[job] for job in jobs]


def _as_dict(value: SamplingLike) -> dict[str, Any]:
    """Sampling parameters as the request body carries them (the gateway validates them)."""
    if isinstance(value, SamplingParams):
        return value.model_dump(mode="json", exclude_none=True)
    return dict(value or {})


def rollserve_rollout_func(
    client: RolloutClient | str | None,
    task_builder: TaskBuilder,
    *,
    data_source: str | None = None,
    sampling: SamplingLike = None,
    agent: AgentLike = None,
    on_failure: OnFailure = "skip",
    on_batch: Callable[[list[Trajectory]], None] | None = None,
    token: str | None = None,
    timeout: float = 60.0,
) -> RollserveRollout:
    """A `rollout_func` for TRL's `GRPOTrainer` whose rollouts run in rollserve.

    `client`: a `RolloutClient`, or the gateway's URL (None: `$ROLLSERVE_URL`), then with
    `token` (None: `$ROLLSERVE_API_TOKEN`) and `timeout` per request. `task_builder`: TRL's
    prompt → the rollserve task (`tasks_by_prompt` builds one from a list of tasks);
    `data_source` fills in the tasks that lack one. `sampling` and `agent`: as in
    `RolloutClient.submit_batch` (a seed moves on by the group size with every batch).
    `on_failure`: what a job that did not complete becomes (module docstring). `on_batch`:
    called with each call's trajectories in TRL's order (also kept in `.last`)."""
    return RollserveRollout(
        client,
        task_builder,
        data_source=data_source,
        sampling=sampling,
        agent=agent,
        on_failure=on_failure,
        on_batch=on_batch,
        token=token,
        timeout=timeout,
    )


def rollserve_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: rollserve's reward of each completion, as graded by the task's
    handler in the service (None, "unscorable" to TRL, for a skipped failed job). Logs each
    completion's job id, status and number of segments to TRL's completions table."""
    rewards = kwargs.get(REWARD_KEY)
    if rewards is None:
        raise ValueError(
            f"no `{REWARD_KEY}` among the reward function's arguments: use it with the "
            "`rollout_func` of `trainers.trl.rollserve_rollout_func`"
        )
    if len(rewards) != len(completions):
        raise ValueError(f"{len(rewards)} rollserve rewards for {len(completions)} completions")
    log_extra = kwargs.get("log_extra")
    if callable(log_extra):
        for key in (JOB_KEY, STATUS_KEY, SEGMENTS_KEY):
            if key in kwargs:
                log_extra(key, list(kwargs[key]))
    return [None if r is None else float(r) for r in rewards]
