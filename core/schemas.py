"""Every JSON that crosses a process boundary: REST bodies, job records, trajectories.

This module is the single source of truth for the wire format. It depends on pydantic only,
so the gateway, the workers and the client all import it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The shared bounds and value types, and the fleet's models, live beside this module; they are
# imported from here like every other part of the wire format.
from core.fleet import MAX_WEIGHT_UPDATE_TIMEOUT as MAX_WEIGHT_UPDATE_TIMEOUT
from core.fleet import Backend as Backend
from core.fleet import BackendSpec as BackendSpec
from core.fleet import BackendWeightUpdate as BackendWeightUpdate
from core.fleet import ResumeRequest as ResumeRequest
from core.fleet import WeightUpdateReport as WeightUpdateReport
from core.fleet import WeightUpdateRequest as WeightUpdateRequest
from core.values import HARNESS_OUTPUT_LIMIT as HARNESS_OUTPUT_LIMIT
from core.values import MAX_POLICY_VERSION as MAX_POLICY_VERSION
from core.values import MAX_SEED as MAX_SEED
from core.values import MAX_STALE_RERUNS as MAX_STALE_RERUNS
from core.values import MAX_TASK_DEPTH as MAX_TASK_DEPTH
from core.values import MAX_TOKENS as MAX_TOKENS
from core.values import Text as Text
from core.values import encodable as encodable
from core.values import json_problem as json_problem


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

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    data_source: Text = Field(min_length=1, max_length=256)
    """Handler name: `math`, `stem`, or a plugin's."""
    instance_id: Text | None = Field(default=None, max_length=4096)
    """The task's own id; one is made up from its content when absent."""


class SamplingParams(BaseModel):
    """How the policy samples; passed through to the inference backend."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """Tokens per model call; the service default when absent."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Base seed: sample i of a group uses `seed + i` (with dynamic sampling, attempt a of a
    task `seed + a*group_size + i`); every sample's seed must stay within 64 bits."""
    stop: list[Text] | None = None
    """Extra stop strings; kept in the output (`include_stop_str_in_output`)."""

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value


DEFAULT_SUMMARY_INSTRUCTION = (
    "Your context is nearly full. Summarise your progress on the task so far: what you "
    "found, what you changed, what is left to do and anything you must not forget. Write "
    "only the summary; it will replace the conversation before your most recent turns."
)
"""What the policy is asked when its context passes `Compaction.threshold`."""


class Compaction(BaseModel):
    """Context compaction in the built-in agent loop: when the sequence the next model call
    would get passes `threshold` tokens, the policy itself first writes a summary (a model
    call, trained on); the episode then goes on from [the task's first messages, the summary,
    the `keep_turns` most recent turns] as a new segment of the same trajectory (reason
    `compaction`), every id of it exact."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    threshold: int = Field(ge=32, le=MAX_TOKENS)
    """Tokens: the sequence length past which the next call first compacts."""
    keep_turns: int = Field(default=2, ge=0, le=100)
    """Most recent model turns (with the replies to them) kept verbatim after the summary;
    fewer when they would not fit under `threshold`."""
    instruction: Text = Field(default=DEFAULT_SUMMARY_INSTRUCTION, min_length=1, max_length=16_384)
    """What the policy is asked, as a user message after the conversation."""
    max_summary_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS)
    """Most tokens of the summary."""


class AgentParams(BaseModel):
    """Limits of the agent loop."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    max_turns: int | None = Field(default=None, ge=1, le=1000)
    """Model calls per job; the service default when absent."""
    max_total_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """Response ids per job (generated and observation); the service default when absent."""
    max_seconds: float | None = Field(default=None, gt=0)
    """Seconds the job may spend in its stages, all together (time in queues does not
    count): RUN stops the episode when it is spent (`stop_reason` `time_budget`), and a job
    whose budget is spent before INIT or RUN starts ends `timed_out`. None: no budget
    beyond each stage's own limits. At most the service's `ROLLSERVE_MAX_SECONDS_LIMIT`."""
    max_staleness: int | None = Field(default=None, ge=0, le=MAX_POLICY_VERSION)
    """Bounded staleness for asynchronous training: a job whose turns come (or would come)
    from a policy older than `current - max_staleness` is stale, where `current` is the
    newest policy version a backend has announced. Checked before every model call and when
    the episode ends. None: no bound (policy versions are still recorded per turn)."""
    on_stale: Literal["rerun", "drop"] | None = None
    """What a stale job does: `rerun` (also when absent) starts its episode again from the
    first turn on the current policy (in a fresh sandbox when it has one; at most
    `MAX_STALE_RERUNS` times, then it is dropped); `drop` ends it `failed` with error type
    `stale_policy`."""
    command: Text | None = Field(default=None, min_length=1, max_length=16_384)
    """Run the job's own agent harness instead of the built-in loop: this command, with
    `bash -c` in the job's sandbox (cwd `/workspace`), with `OPENAI_BASE_URL`,
    `OPENAI_API_KEY`, `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` pointing at the job's
    own endpoint and `ROLLSERVE_INSTRUCTION_FILE` naming a file with the task's
    instruction. Its exit ends RUN; the task's grader runs as usual. Only for tasks whose
    handler runs a sandbox."""
    compaction: Compaction | None = None
    """Compact the context by a summary the policy writes (see `Compaction`); None: an
    episode whose context fills ends `context_length`. Only for the built-in agent loop
    (not with `command`)."""

    @model_validator(mode="after")
    def _compaction_in_the_built_in_loop(self) -> AgentParams:
        if self.compaction is not None and self.command is not None:
            raise ValueError(
                "agent.compaction applies to the built-in agent loop; a harness of your own "
                "(agent.command) compacts its history itself"
            )
        return self


class RolloutRequest(BaseModel):
    """Body of `POST /v1/rollouts`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: Task
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentParams = Field(default_factory=AgentParams)


class SessionRequest(BaseModel):
    """Body of `POST /v1/sessions`: a job driven by a harness outside the service (an OpenAI
    Agents SDK or LangGraph program in the trainer's process) through its own endpoint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: Task
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentParams = Field(default_factory=AgentParams)
    """Its budgets bound the session's calls; `agent.command` has no place here (the harness
    is the caller's)."""
    idle_seconds: float = Field(default=600.0, gt=0, le=86_400)
    """The session ends (`stop_reason` `session_idle`, graded as asked at its end, or by the
    task's grader) when no call or tool reaches it for this long."""

    @field_validator("agent")
    @classmethod
    def _no_command(cls, value: AgentParams) -> AgentParams:
        if value.command is not None:
            raise ValueError("a session's harness is the caller's own: leave out agent.command")
        if value.compaction is not None:
            raise ValueError(
                "a session's history is the caller's own to compact: leave out agent.compaction"
            )
        return value


class SessionOpened(BaseModel):
    """Answer of `POST /v1/sessions`: where the caller's harness sends its model calls."""

    job_id: str
    base_url: str
    """The session's root: `{base_url}/v1/chat/completions`, `/v1/responses`, `/v1/messages`,
    `/tools/{name}` and `/end`."""
    openai_base_url: str
    """`OPENAI_BASE_URL` for the session (`{base_url}/v1`)."""
    anthropic_base_url: str
    """`ANTHROPIC_BASE_URL` for the session (`base_url`)."""
    api_key: str
    """The session's key (`Authorization: Bearer` or `x-api-key`), shown only here: it opens
    this job's endpoint only, and only while it runs."""
    tools: list[dict[str, Any]] | None = None
    """The task's sandbox tools (OpenAI shape), callable at `{base_url}/tools/{name}`, when
    the task has a sandbox."""


class SessionEnd(BaseModel):
    """Body of `POST {base_url}/end`: the caller's own reward, or `grade` for the task's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    reward: float | None = None
    grade: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> SessionEnd:
        if self.grade == (self.reward is not None):
            raise ValueError("give either a reward or grade: true (exactly one)")
        return self


class DynamicSampling(BaseModel):
    """DAPO dynamic sampling options of a batch: the batch's tasks are a pool from which groups
    are drawn until `target_groups` informative groups (not all rewards equal) are complete."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    target_groups: int = Field(ge=1)
    """Informative groups to return; at most the number of tasks in the pool."""
    group_size: int | None = Field(default=None, ge=2, le=1024)
    """Jobs per group; the batch's `group_size` when absent. Given both, they must agree."""
    max_inflight_groups: int | None = Field(default=None, ge=1, le=100_000)
    """Groups kept in flight at once; `target_groups` when absent."""
    max_attempts_per_task: int = Field(default=1, ge=1, le=100)
    """Draws of one task: a task whose group was set aside (uniform rewards, a failed job) is
    drawn again, with fresh seeds, until it has had this many."""
    early_cancel: bool = True
    """Cancel every unfinished job once the target is met (false: let them finish and
    discard them, a baseline for `bench/dapo.py`)."""


class BatchRequest(BaseModel):
    """Body of `POST /v1/batches`: every task becomes `group_size` jobs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tasks: list[Task] = Field(min_length=1, max_length=100_000)
    group_size: int = Field(default=1, ge=1, le=1024, strict=True)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentParams = Field(default_factory=AgentParams)
    dynamic_sampling: DynamicSampling | None = None
    """DAPO dynamic sampling over the tasks as a pool (see `DynamicSampling`)."""


# ----------------------------------------------------------------------------- responses


class RolloutAccepted(BaseModel):
    job_id: str


class BatchAccepted(BaseModel):
    batch_id: str
    jobs: list[str]


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
    backend_id: str | None = None
    """The backend that generated this turn (a job moves when its backend is drained or lost)."""
    policy_version: int | None = None
    """The weights that generated this turn, as its backend announced them."""
    llm_seconds: float = 0.0
    turn_seconds: float = 0.0
    """Wall time from this call's start until the reply to it was appended (model, tools,
    templating and bookkeeping); 0 for a last turn that no reply followed."""
    segment_start: str | None = None
    """Why this call began a new segment (see `Segment`), when it did: its `prompt_ids` are
    then the new segment's whole prompt. None on the first call and on every call whose
    prompt extends the sequence before it."""


class EnvTurn(BaseModel):
    """One environment reply, appended as ids after the model's turn."""

    type: Literal["env"] = "env"
    observation_ids: list[int]
    """Ids appended: the chat template's turn markers and the observation's content."""
    text: str
    tool_seconds: float = 0.0


Turn = Annotated[ModelTurn | EnvTurn, Field(discriminator="type")]

SEGMENT_REASONS = {
    "start": "the trajectory's first segment",
    "history_changed": "the harness sent an earlier message differently, or left one out "
    "(it edited, truncated or summarised its history)",
    "reply_changed": "the harness sent the model's last reply back other than it was returned",
    "tools_changed": "the harness declared other tools than on its previous call",
    "retried": "the harness sent its previous request again instead of continuing it",
    "rerendered": "the chat template renders the conversation differently from the ids "
    "generated so far",
    "compaction": "the context passed agent.compaction's threshold: the policy summarised the "
    "episode, which goes on from the task, the summary and the most recent turns",
}
"""Why a segment begins, by name: the value says what happened."""


class Segment(BaseModel):
    """One trainable sequence of a trajectory.

    A job's ids form one sequence as long as every model call's prompt extends the previous
    call's prompt and output. When a call's prompt does not (a harness edited its history, the
    template rendered earlier turns differently), that call starts a new segment: its own
    prompt, and the ids after it. `reason` is one of `SEGMENT_REASONS`."""

    reason: str
    first_turn: int
    """Index in the trajectory's `turns` of the segment's first model call."""
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    policy_versions: list[int | None] = Field(default_factory=list)
    """The policy version of each of the segment's model calls, in order."""


class Resume(BaseModel):
    """One continuation of the episode by a worker that took RUN over from one that died, in
    the same sandbox: the turns saved before it were kept, not generated or run again."""

    turn: int
    """Index in the trajectory's `turns` where the episode went on (the turns before it were
    saved by the earlier worker)."""
    dropped_turns: int = 0
    """Saved turns not kept: a last model turn whose tool calls may have run without their
    results being saved (0 or 1); its call is made again."""
    reprefill_ids: int = 0
    """Ids the next call re-sends as its prompt (the backend prefills them again, unless its
    prefix cache still holds them)."""
    attempt: int = 0
    """The job's attempt that resumed (it counts every takeover)."""


class HarnessRun(BaseModel):
    """How the job's own agent harness ran: `agent.command` in its sandbox, or a session's
    caller outside the service."""

    command: str | None = None
    """The harness's command (`agent.command`); None for a session driven from outside."""
    exit_code: int | None = None
    """Its exit status (128+n when signal n ended it); None when it was stopped (cancelled,
    out of time)."""
    timed_out: bool = False
    killed_by: str | None = None
    """The box limit that stopped it (`memory_bytes`, `box_pids`, ...), when one did."""
    stdout: str = ""
    stderr: str = ""
    """Its output, each cut to `HARNESS_OUTPUT_LIMIT` bytes (the cut is marked)."""
    calls: int = 0
    """Model calls it made through its endpoint."""
    refused_calls: int = 0
    """Calls the endpoint refused (a budget spent, a request it cannot serve)."""


class EgressEvent(BaseModel):
    """One connection (or name lookup) from a sandbox with network, and what its egress
    policy made of it."""

    time: float
    """Unix time of the decision."""
    kind: Literal["connect", "dns", "log_full"] = "connect"
    """`connect`: a TCP connection; `dns`: a name lookup that was refused (allowed lookups
    are not recorded, their connections are); `log_full`: the sandbox's log reached its cap
    and later events were not recorded."""
    host: str | None = None
    """The name the box asked for (TLS server name, HTTP `Host`, or looked-up name); None
    when it gave none."""
    port: int | None = None
    address: str | None = None
    """The address the box connected to (before it was sent to the egress proxy)."""
    allowed: bool = False
    reason: str | None = None
    """Why it was refused."""
    error: str | None = None
    """Why an allowed connection failed (name not found, host unreachable)."""


LIMIT_NAMES = ("memory", "disk", "inodes", "processes", "time")
"""The box-wide limits a trajectory reports hitting (`LimitHit.limit`)."""


class LimitHit(BaseModel):
    """A box-wide limit that stopped or held something of the job's sandbox during the
    episode: `memory` (the kernel killed a process for the box's memory limit), `processes`
    (a fork was refused), `disk` / `inodes` (the box's own disk was full), `time` (a tool
    call ran out of time and was interrupted)."""

    limit: Literal["memory", "disk", "inodes", "processes", "time"]
    count: int = 1
    """How often it held: OOM kills, refused forks, tool calls stopped by it (at least 1)."""
    detail: str = ""


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
    """`answer`, `finish`, `max_turns`, `token_budget`, `time_budget` (`agent.max_seconds`
    was spent), `context_length` or `invalid_token` (the model generated an id outside the
    backend's vocabulary, which no later prompt may carry; the trajectory keeps it as
    returned and is graded as usual)."""
    truncated: bool = False
    """True when the episode was cut by the token budget, the time budget or the context
    length."""
    tool_calls: int = 0
    """Well-formed tool calls the model made."""
    malformed_tool_calls: int = 0
    """Tool calls that could not be parsed (each got an error message back)."""
    stale_reruns: int = 0
    """Times the episode was started again because its turns went stale
    (`agent.max_staleness`); the turns here are all from the last start."""
    resumes: list[Resume] = Field(default_factory=list)
    """Where a worker that took RUN over from a dead one went on from the last saved turn
    (empty when the episode ran in one go, or started again from its first turn)."""
    timing: Timing = Field(default_factory=Timing)
    hosts: dict[str, str] = Field(default_factory=dict)
    """The worker node that ran each stage (`init`, `run`, `eval`)."""
    error: StageError | None = None
    egress: list[EgressEvent] = Field(default_factory=list)
    """The connections a sandbox with network tried during the episode, allowed or refused,
    in order (empty without network)."""
    limits: list[LimitHit] = Field(default_factory=list)
    """The box-wide limits the job's sandbox ran into during the episode, one entry per limit
    (empty when none held it, or the job had no sandbox): a trainer tells a policy that
    filled the disk from one that failed the task."""
    harness: HarnessRun | None = None
    """How the job's own harness ran, for a job with `agent.command`."""
    turns: list[Turn] = Field(default_factory=list)
    prompt_ids: list[int] = Field(default_factory=list)
    """The first segment's prompt (the first model call's)."""
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    """The segments after the first, each a trainable sequence of its own (the arrays above
    are the first); empty when the whole trajectory is one sequence, as the built-in agent
    loop's is unless its chat template cannot be continued by appending ids (`rerendered`).
    `core.flatten.sequences` gives all of them in one list."""
    created_at: float | None = None
    finished_at: float | None = None


class DynamicProgress(BaseModel):
    """The dynamic-sampling part of `GET /v1/batches/{id}`."""

    state: Literal["running", "draining", "cancelling", "done"]
    """`running` draws groups; `cancelling` stops the rest after the target (or a cancel);
    `draining` lets them finish (`early_cancel` false); `done` once nothing of it runs."""
    target_groups: int
    group_size: int
    max_inflight_groups: int
    max_attempts_per_task: int
    early_cancel: bool
    pool_size: int
    groups_drawn: int
    groups_in_flight: int
    groups_accepted: int
    """Complete and informative: what the results stream returns (at most the target)."""
    groups_filtered: int
    """Complete with every reward equal (uninformative)."""
    groups_failed: int
    """Complete, but a job failed or timed out (no reward)."""
    groups_cancelled: int
    """Cut short: a job of it was cancelled (by the target's cancellation or a request)."""
    groups_surplus: int
    """Completed after the target was met."""
    rollouts_used: int
    """Jobs of accepted groups. `rollouts_*` count jobs that started (a job cancelled while
    queued costs nothing)."""
    rollouts_filtered: int
    """Started jobs of filtered and failed groups: the price of finding them uninformative."""
    rollouts_wasted: int
    """Started jobs of cancelled and surplus groups: work beyond what the target needed."""
    rollout_seconds_used: float
    """Seconds from each job's first stage to its end, summed, per category as above."""
    rollout_seconds_filtered: float
    rollout_seconds_wasted: float
    target_reached: bool
    time_to_target: float | None
    """Seconds from submission until the target's last group completed."""
    time_to_done: float | None
    """Seconds from submission until the batch was done (every cancelled job stopped)."""
    unconfirmed_stops: int
    """Cancelled jobs not yet confirmed stopped (a stage still running or a sandbox up)."""
    accepted_groups: list[str]
    """Group ids of the accepted groups, in order of completion."""
    tasks_never_drawn: list[int]
    """Indexes into the request's `tasks` that were never drawn: carry them over."""


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
    """Every job has ended and every cancelled one is confirmed stopped (for a dynamic batch:
    its state is `done`)."""
    created_at: float
    dynamic: DynamicProgress | None = None
    """Present for a batch with dynamic sampling."""


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    redis: bool
    backends: int


class Readiness(BaseModel):
    """`GET /readyz`: whether the service can run jobs now, and if not, what it lacks."""

    ready: bool
    missing: list[str]
    """What is missing, e.g. `a worker on queue eval`, `a healthy backend`."""


class SandboxLimitSupport(BaseModel):
    """Whether one box-wide sandbox limit holds on a worker node, and how (or why not)."""

    enforced: bool
    detail: str
    """How it is enforced (the cgroup file, the box's tmpfs), or why it is not."""


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
    sandbox_limits: dict[str, dict[str, SandboxLimitSupport]] | None = None
    """Per worker node: which box-wide limits its sandboxes get (`memory`, `pids`, `cpu`,
    `disk`, `inodes`), enforced or not; None until a worker has reported."""


class FieldError(BaseModel):
    """One refused part of a request: where it is (`loc`, e.g. `["body", "task", "problem"]`),
    why (`msg`) and what kind of error (`type`); for a value that failed validation also the
    value (`input`, as text where strict JSON cannot carry it) and the rule's bounds (`ctx`)."""

    loc: list[str | int]
    msg: str
    type: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ErrorBody(BaseModel):
    """The body of every error answer: `detail` says why, as a sentence, or as the list of
    refused fields (422)."""

    detail: str | list[FieldError]
