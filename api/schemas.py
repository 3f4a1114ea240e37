"""Every JSON that crosses a process boundary: REST bodies, job records, trajectories.

This module is the single source of truth for the wire format. It depends on pydantic only,
so the gateway, the workers and the client all import it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobStatus(StrEnum):
    """Where a job is: `queued → init → run → eval → completed | failed | cancelled | timed_out`."""

    queued = "queued"
    init = "init"
    run = "run"
    eval = "eval"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.timed_out}
)
STAGES = ("init", "run", "eval")


# ----------------------------------------------------------------------------- requests


class Task(BaseModel):
    """One problem instance; `data_source` picks its handler, the other fields are the handler's."""

    model_config = ConfigDict(extra="allow")

    data_source: str = Field(min_length=1)
    """Handler name: `math`, `stem`, or a plugin's."""
    instance_id: str | None = None
    """The task's own id; one is made up from its content when absent."""


class SamplingParams(BaseModel):
    """How the policy samples; passed through to the inference backend."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens per model call; the service default when absent."""
    seed: int | None = None
    """Base seed: sample i of a group uses `seed + i`."""
    stop: list[str] | None = None
    """Extra stop strings; kept in the output (`include_stop_str_in_output`)."""

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value


class AgentParams(BaseModel):
    """Limits of the agent loop."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = Field(default=None, ge=1, le=1000)
    """Model calls per job; the service default when absent."""
    max_total_tokens: int | None = Field(default=None, ge=1)
    """Response ids per job (generated and observation); the service default when absent."""


class RolloutRequest(BaseModel):
    """Body of `POST /v1/rollouts`."""

    model_config = ConfigDict(extra="forbid")

    task: Task
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentParams = Field(default_factory=AgentParams)


class DynamicSampling(BaseModel):
    """DAPO dynamic sampling options of a batch."""

    model_config = ConfigDict(extra="forbid")

    target_groups: int = Field(ge=1)


class BatchRequest(BaseModel):
    """Body of `POST /v1/batches`: every task becomes `group_size` jobs."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[Task] = Field(min_length=1, max_length=100_000)
    group_size: int = Field(default=1, ge=1, le=1024)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentParams = Field(default_factory=AgentParams)
    dynamic_sampling: DynamicSampling | None = None
    """Not available in this version: a non-null value is refused with a 422."""


class BackendSpec(BaseModel):
    """Body of `POST /v1/backends`."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://[^\s/]+(:\d+)?(/[^\s]*)?$")
    """Base URL of the inference server, e.g. `http://gpu-node-3:8000`."""
    kind: Literal["vllm", "sglang"] = "vllm"
    model: str = Field(min_length=1)
    """Model name the server serves (its `--served-model-name`)."""
    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    """Stable id; derived from the URL when absent."""
    policy_version: int | None = None
    """Version of the weights this server holds; copied into trajectories."""
    api: Literal["completions", "generate"] = "completions"
    """vLLM only: `completions` speaks `/v1/completions` (token ids in, `return_token_ids`),
    `generate` speaks `/inference/v1/generate` (tokens in, tokens out). SGLang always speaks
    its native `/generate`."""
    capacity: float = Field(default=1.0, gt=0.0, le=1e6)
    """Relative capacity (e.g. GPUs or batch slots): a backend with capacity 2 is assigned
    twice the jobs of one with capacity 1 before it counts as equally loaded."""


# ----------------------------------------------------------------------------- responses


class RolloutAccepted(BaseModel):
    job_id: str


class BatchAccepted(BaseModel):
    batch_id: str
    jobs: list[str]


class Backend(BaseModel):
    """A registered inference server as `GET /v1/backends` shows it."""

    id: str
    url: str
    kind: Literal["vllm", "sglang"]
    model: str
    policy_version: int | None = None
    api: Literal["completions", "generate"] = "completions"
    capacity: float = 1.0
    in_flight: int = 0
    """Jobs currently holding this backend."""
    state: Literal["healthy", "draining", "dead"] = "healthy"
    """`healthy` takes jobs; `draining` takes none and lets running requests finish;
    `dead` failed its health checks (or a request) and is re-admitted when it answers."""
    idle: bool = True
    """No job holds it: after a drain, the moment weights can be swapped."""
    failures: int = 0
    """Consecutive failed health checks."""
    registered_at: float


class StageError(BaseModel):
    """Why a job did not complete."""

    stage: str
    """`queued`, `init`, `run` or `eval`: where it happened."""
    type: str
    """Short machine-readable kind, e.g. `BackendError`, `cancelled`, `SoftTimeLimitExceeded`."""
    message: str


class Timing(BaseModel):
    """Seconds per stage; `llm` and `tools` are the parts of `run` spent in each."""

    queue: float | None = None
    init: float | None = None
    run: float | None = None
    eval: float | None = None
    llm: float = 0.0
    tools: float = 0.0


class ModelTurn(BaseModel):
    """One call to the policy."""

    type: Literal["model"] = "model"
    prompt_ids: list[int]
    """Ids added to the sequence since the previous call (the whole prompt on the first)."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    llm_seconds: float = 0.0
    turn_seconds: float = 0.0
    """Wall time from this call's start until the reply to it was appended (model, tools,
    templating and bookkeeping); 0 for a last turn that no reply followed."""


class EnvTurn(BaseModel):
    """One environment reply, appended as ids after the model's turn."""

    type: Literal["env"] = "env"
    observation_ids: list[int]
    """Ids appended: the chat template's turn markers and the observation's content."""
    text: str
    tool_seconds: float = 0.0


Turn = Annotated[ModelTurn | EnvTurn, Field(discriminator="type")]


class Trajectory(BaseModel):
    """What the trainer gets for one job (partial while it runs or when it did not complete)."""

    job_id: str
    group_id: str
    batch_id: str | None = None
    instance_id: str
    data_source: str
    sample_index: int = 0
    status: JobStatus
    reward: float | None = None
    eval: dict[str, Any] = Field(default_factory=dict)
    outcome: dict[str, Any] = Field(default_factory=dict)
    """What the episode produced in its sandbox, e.g. the `patch` of a SWE task."""
    policy_version: int | None = None
    backend_id: str | None = None
    stop_reason: str | None = None
    """`answer`, `finish`, `max_turns`, `token_budget` or `context_length`."""
    truncated: bool = False
    """True when the episode was cut by the token budget or the context length."""
    tool_calls: int = 0
    """Well-formed tool calls the model made."""
    malformed_tool_calls: int = 0
    """Tool calls that could not be parsed (each got an error message back)."""
    timing: Timing = Field(default_factory=Timing)
    hosts: dict[str, str] = Field(default_factory=dict)
    """The worker node that ran each stage (`init`, `run`, `eval`)."""
    error: StageError | None = None
    turns: list[Turn] = Field(default_factory=list)
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    created_at: float | None = None
    finished_at: float | None = None


class BatchProgress(BaseModel):
    """`GET /v1/batches/{id}`."""

    batch_id: str
    total: int
    group_size: int
    counts: dict[str, int]
    """Jobs per status."""
    finished: int
    groups_total: int
    groups_finished: int
    mean_reward: float | None
    done: bool
    created_at: float


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    redis: bool
    backends: int


class Stats(BaseModel):
    """`GET /v1/stats`: a snapshot of the fleet."""

    queues: dict[str, int]
    """Messages waiting per queue."""
    jobs: dict[str, int]
    """Jobs per status (all time, since the store began)."""
    busy: dict[str, int]
    """Jobs inside each stage right now."""
    workers: dict[str, int]
    """Worker processes seen alive per queue."""
    backends: dict[str, int]
    """In-flight jobs per backend."""
    completed_last_minute: int
    throughput_per_s: float


class ErrorBody(BaseModel):
    detail: Any
