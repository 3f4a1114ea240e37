"""What the gateway does, as plain functions over the job store, the backend pool and Celery."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from api import owners
from api.cursors import CursorError, make_cursor, parse_cursor
from broker.jobstore import DynamicOptions, JobSpec, JobStore, PoolTask
from core.schemas import (
    MAX_SEED,
    AgentParams,
    BatchProgress,
    BatchRequest,
    RolloutRequest,
    SamplingParams,
    SessionOpened,
    SessionRequest,
    Task,
    Trajectory,
    json_problem,
)
from core.settings import Settings
from routing.pool import BackendPool
from workers.dapo import submit_dynamic
from workers.dispatch import Dispatcher, DispatchError
from workers.handlers.base import TaskValidationError
from workers.handlers.registry import UnknownDataSource, get_handler, known_handlers
from workers.harness import sessions

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the service refuses; `loc` names the offending field as FastAPI would."""

    def __init__(self, status_code: int, message: str, loc: Sequence[str | int] = ()) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.loc = list(loc)


@dataclass
class Services:
    """Everything a route needs, built once per gateway process."""

    settings: Settings
    store: JobStore
    pool: BackendPool
    celery: Celery
    dispatcher: Dispatcher = field(init=False)
    """Sends and stops jobs; hooked into `store` so ends recorded here are followed up."""

    def __post_init__(self) -> None:
        self.dispatcher = Dispatcher(
            self.store,
            self.pool,
            self.celery,
            self.settings.node_name,
            self.settings.cancel_grace,
            self.settings.broker_send_timeout,
        )


def instance_id_of(task: Task) -> str:
    """The task's own id, or a stable one from its content."""
    if task.instance_id:
        return task.instance_id
    digest = hashlib.sha1(json.dumps(task.model_dump(), sort_keys=True).encode()).hexdigest()
    return f"{task.data_source}-{digest[:12]}"


def validate_task(task: Task, loc: Sequence[str | int]) -> None:
    """Check the task is strict JSON, its handler exists and accepts it; raise a RequestError
    naming the field."""
    data = task.model_dump()
    problem = json_problem(data)
    if problem is not None:
        path, message = problem
        raise RequestError(422, message, [*loc, *path])
    try:
        handler = get_handler(task.data_source)
    except UnknownDataSource:
        known = ", ".join(known_handlers())
        raise RequestError(
            422, f"unknown data_source {task.data_source!r}; known: {known}", [*loc, "data_source"]
        ) from None
    try:
        handler.validate(data)
    except TaskValidationError as exc:
        raise RequestError(422, exc.message, [*loc, *exc.field.split(".")]) from None
    except Exception as exc:  # a handler (a plugin's) that fails on input it should refuse
        log.exception("the %r handler failed to validate a task", task.data_source)
        raise RequestError(
            422, f"the {task.data_source} handler cannot read the task: {exc}", loc
        ) from None


def check_harness(agent: AgentParams, task: Task, loc: Sequence[str | int]) -> None:
    """Refuse `agent.command` for a task whose handler runs no sandbox: the harness runs in
    the job's box."""
    if agent.command is None:
        return
    if not get_handler(task.data_source).needs_sandbox:
        raise RequestError(
            422,
            f"agent.command runs the harness in the job's sandbox, but {task.data_source!r} "
            "tasks have none (use a handler with a sandbox: shell, swe, code)",
            [*loc, "data_source"],
        )


def check_seed_span(sampling: SamplingParams, samples: int) -> None:
    """Refuse a base seed whose samples' seeds (`seed` to `seed + samples - 1`) would pass the
    largest 64-bit seed."""
    if sampling.seed is not None and sampling.seed + samples - 1 > MAX_SEED:
        raise RequestError(
            422,
            f"seed {sampling.seed} is too large: its {samples} samples per task use seeds up "
            f"to seed + {samples - 1}, past the largest seed {MAX_SEED}",
            ["body", "sampling", "seed"],
        )


def resolve_sampling(sampling: SamplingParams, settings: Settings) -> dict[str, Any]:
    data = sampling.model_dump()
    if data["max_tokens"] is None:
        data["max_tokens"] = settings.max_tokens
    return data


def resolve_agent(agent: AgentParams, settings: Settings) -> dict[str, Any]:
    """The agent parameters with the service defaults filled in; a time budget above
    `ROLLSERVE_MAX_SECONDS_LIMIT` is refused (422)."""
    if agent.max_seconds is not None and agent.max_seconds > settings.max_seconds_limit:
        raise RequestError(
            422,
            f"agent.max_seconds {agent.max_seconds:g} is above this service's limit of "
            f"{settings.max_seconds_limit:g} seconds (ROLLSERVE_MAX_SECONDS_LIMIT)",
            ["body", "agent", "max_seconds"],
        )
    resolved: dict[str, Any] = {
        "max_turns": agent.max_turns or settings.max_turns,
        "max_total_tokens": agent.max_total_tokens or settings.max_total_tokens,
    }
    if agent.max_seconds is not None:
        resolved["max_seconds"] = agent.max_seconds
    if agent.max_staleness is not None:
        resolved["max_staleness"] = agent.max_staleness
        resolved["on_stale"] = agent.on_stale or "rerun"
    if agent.command is not None:
        resolved["command"] = agent.command
    if agent.compaction is not None:
        resolved["compaction"] = agent.compaction.model_dump()
    return resolved


def _require_backend(svc: Services) -> None:
    if svc.pool.count() == 0:
        raise RequestError(
            503,
            "no inference backend is registered: POST /v1/backends "
            '{"url": "http://host:8000", "kind": "vllm", "model": "..."} first',
        )


def check_token_limits(svc: Services, sampling: SamplingParams, loc: Sequence[str | int]) -> None:
    """Refuse a `sampling.max_tokens` above the largest context length among the registered
    backends (as they reported it at registration); accept any when none reported one."""
    if sampling.max_tokens is None:
        return
    contexts = [b.max_model_len for b in svc.pool.list() if b.max_model_len]
    if contexts and sampling.max_tokens > max(contexts):
        raise RequestError(
            422,
            f"max_tokens ({sampling.max_tokens}) exceeds the largest context length of the "
            f"registered backends ({max(contexts)} tokens)",
            [*loc, "max_tokens"],
        )


def check_task_size(svc: Services, task: Task, loc: Sequence[str | int]) -> None:
    """Refuse a task whose JSON exceeds `ROLLSERVE_MAX_TASK_BYTES` (413 naming it)."""
    size = len(json.dumps(task.model_dump(), ensure_ascii=False).encode("utf-8", "replace"))
    limit = svc.settings.max_task_bytes
    if size > limit:
        raise RequestError(
            413,
            f"the task is {size} bytes of JSON, over the {limit}-byte limit "
            "(ROLLSERVE_MAX_TASK_BYTES)",
            loc,
        )


def check_job_count(svc: Services, jobs: int, what: str, loc: Sequence[str | int]) -> None:
    """Refuse a request that would create more than `ROLLSERVE_MAX_JOBS_PER_REQUEST` jobs."""
    limit = svc.settings.max_jobs_per_request
    if jobs > limit:
        raise RequestError(
            413,
            f"{what} make {jobs} jobs, over the {limit}-job limit of one request "
            "(ROLLSERVE_MAX_JOBS_PER_REQUEST); split it into several batches",
            loc,
        )


def check_quota(svc: Services, tenant: str, jobs: int) -> None:
    """Refuse (429) a submission that would take the tenant past `ROLLSERVE_MAX_QUEUED_JOBS`
    unfinished jobs. The count is recounted from the records before refusing, so jobs whose
    records expired never hold a quota."""
    limit = svc.settings.max_queued_jobs
    if svc.store.unfinished(tenant) + jobs <= limit:
        return
    unfinished = svc.store.unfinished(tenant, recount=True)
    if unfinished + jobs > limit:
        raise RequestError(
            429,
            f"{unfinished} jobs of yours have not finished and this request adds {jobs}: over "
            f"the limit of {limit} unfinished jobs (ROLLSERVE_MAX_QUEUED_JOBS); wait for some "
            "to finish or cancel them",
        )


def owner_ttl(settings: Settings) -> int:
    """Seconds the record of who owns a batch or job lives: as long as its results do."""
    return max(settings.job_ttl, settings.results_keep)


def _enqueue(
    svc: Services, specs: list[JobSpec], batch_id: str | None, group_size: int, tenant: str
) -> None:
    """Enqueue the jobs (their owner already claimed); a 503, with nothing kept, when the
    broker does not take them."""
    try:
        svc.dispatcher.enqueue_specs(specs, batch_id, group_size, tenant)
    except DispatchError as exc:
        lone = specs[0].job_id if batch_id is None and len(specs) == 1 else None
        owners.release(svc.store, tenant, batch_id=batch_id, job_id=lone)
        raise RequestError(503, str(exc)) from exc


def _enqueue_one(
    svc: Services,
    request: RolloutRequest | SessionRequest,
    tenant: str,
    agent_fields: dict[str, Any] | None = None,
) -> str:
    """Validate the request's one job and enqueue it, with `agent_fields` beside its
    resolved agent parameters; returns its id."""
    validate_task(request.task, ["body", "task"])
    check_harness(request.agent, request.task, ["body", "task"])
    check_task_size(svc, request.task, ["body", "task"])
    _require_backend(svc)
    check_token_limits(svc, request.sampling, ["body", "sampling"])
    check_quota(svc, tenant, 1)
    spec = JobSpec(
        task=request.task.model_dump(),
        data_source=request.task.data_source,
        instance_id=instance_id_of(request.task),
        sampling=resolve_sampling(request.sampling, svc.settings),
        agent=resolve_agent(request.agent, svc.settings) | (agent_fields or {}),
        group_id=uuid.uuid4().hex,
    )
    owners.claim(svc.store, tenant, owner_ttl(svc.settings), job_id=spec.job_id)
    _enqueue(svc, [spec], None, 1, tenant)
    return spec.job_id


def submit_rollout(svc: Services, request: RolloutRequest, tenant: str = "anonymous") -> str:
    """Validate and enqueue one job; returns its id."""
    return _enqueue_one(svc, request, tenant)


def open_session(
    svc: Services, request: SessionRequest, base_url: str, tenant: str = "anonymous"
) -> SessionOpened:
    """Validate and enqueue a session's job; its key is made here and shown only in the
    answer (the job keeps its SHA-256)."""
    key = secrets.token_urlsafe(32)
    fields = {sessions.KEY_HASH: sessions.key_hash(key), sessions.IDLE: request.idle_seconds}
    job_id = _enqueue_one(svc, request, tenant, fields)
    handler = get_handler(request.task.data_source)
    tools = None
    if handler.needs_sandbox:
        declared = handler.tools(request.task.model_dump()) or []
        tools = [t for t in declared if (t.get("function") or t).get("name") != "finish"]
    root = f"{base_url.rstrip('/')}/v1/sessions/{job_id}"
    return SessionOpened(
        job_id=job_id,
        base_url=root,
        openai_base_url=f"{root}/v1",
        anthropic_base_url=root,
        api_key=key,
        tools=tools,
    )


def resolve_dynamic(request: BatchRequest) -> DynamicOptions | None:
    """The batch's dynamic-sampling options with defaults filled in, or None for a plain batch;
    a RequestError naming the field for options that cannot work."""
    dynamic = request.dynamic_sampling
    if dynamic is None:
        return None
    loc = ["body", "dynamic_sampling"]
    if dynamic.group_size is None:
        group_size = request.group_size
        if group_size < 2:
            raise RequestError(
                422,
                "dynamic sampling needs group_size >= 2: a group of one reward is always "
                "uniform, so it could never be informative",
                ["body", "group_size"],
            )
    elif "group_size" in request.model_fields_set and request.group_size != dynamic.group_size:
        raise RequestError(
            422,
            f"dynamic_sampling.group_size ({dynamic.group_size}) differs from group_size "
            f"({request.group_size}); give one of them, or the same value",
            [*loc, "group_size"],
        )
    else:
        group_size = dynamic.group_size
    pool = len(request.tasks)
    if dynamic.target_groups > pool:
        raise RequestError(
            422,
            f"target_groups ({dynamic.target_groups}) exceeds the pool of {pool} tasks: a task "
            "yields at most one accepted group",
            [*loc, "target_groups"],
        )
    return DynamicOptions(
        target_groups=dynamic.target_groups,
        group_size=group_size,
        max_inflight_groups=dynamic.max_inflight_groups or dynamic.target_groups,
        max_attempts_per_task=dynamic.max_attempts_per_task,
        early_cancel=dynamic.early_cancel,
    )


def submit_batch(
    svc: Services, request: BatchRequest, tenant: str = "anonymous"
) -> tuple[str, list[str]]:
    """Validate every task first, then write and enqueue `group_size` jobs per task (with
    dynamic sampling: the first `max_inflight_groups` groups drawn from the tasks)."""
    dynamic = resolve_dynamic(request)
    # With dynamic sampling, attempt a of a task samples with seeds `seed + a*group_size + i`.
    if dynamic is None:
        check_seed_span(request.sampling, request.group_size)
    else:
        check_seed_span(request.sampling, dynamic.max_attempts_per_task * dynamic.group_size)
    if dynamic is None:
        count = len(request.tasks) * request.group_size
        what = f"{len(request.tasks)} tasks x group_size {request.group_size}"
        check_job_count(svc, count, what, ["body", "tasks"])
    else:
        count = min(dynamic.max_inflight_groups, len(request.tasks)) * dynamic.group_size
        what = f"{dynamic.max_inflight_groups} groups in flight x group_size {dynamic.group_size}"
        check_job_count(svc, count, what, ["body", "dynamic_sampling", "max_inflight_groups"])
    for index, task in enumerate(request.tasks):
        validate_task(task, ["body", "tasks", index])
        check_harness(request.agent, task, ["body", "tasks", index])
        check_task_size(svc, task, ["body", "tasks", index])
    _require_backend(svc)
    check_token_limits(svc, request.sampling, ["body", "sampling"])
    check_quota(svc, tenant, count)
    batch_id = uuid.uuid4().hex
    owners.claim(svc.store, tenant, owner_ttl(svc.settings), batch_id=batch_id)
    sampling = resolve_sampling(request.sampling, svc.settings)
    agent = resolve_agent(request.agent, svc.settings)
    if dynamic is not None:
        pool = [
            PoolTask(task=t.model_dump(), data_source=t.data_source, instance_id=instance_id_of(t))
            for t in request.tasks
        ]
        try:
            jobs = submit_dynamic(svc.dispatcher, batch_id, pool, dynamic, sampling, agent, tenant)
        except DispatchError as exc:
            owners.release(svc.store, tenant, batch_id=batch_id)
            raise RequestError(503, str(exc)) from exc
        return batch_id, jobs
    specs: list[JobSpec] = []
    for task in request.tasks:
        group_id = uuid.uuid4().hex
        instance_id = instance_id_of(task)
        data = task.model_dump()  # one copy for the group: the store keeps it once per group
        for sample in range(request.group_size):
            specs.append(
                JobSpec(
                    task=data,
                    data_source=task.data_source,
                    instance_id=instance_id,
                    sampling=sampling,
                    agent=agent,
                    group_id=group_id,
                    sample_index=sample,
                    batch_id=batch_id,
                )
            )
    _enqueue(svc, specs, batch_id, request.group_size, tenant)
    return batch_id, [s.job_id for s in specs]


def cancel_jobs(svc: Services, job_ids: Sequence[str]) -> int:
    """Cancel the live jobs among `job_ids`: record them cancelled, revoke their tasks
    (terminating running ones), free their backends and sandboxes.

    Returns how many were cancelled by this call (finished jobs are left as they are).
    """
    for job_id in job_ids:
        svc.store.status(job_id)  # 404 for an unknown id
    return len(svc.dispatcher.cancel_jobs(job_ids))


def cancel_batch(svc: Services, batch_id: str, wait: float = 30.0) -> BatchProgress:
    """Stop all work of the batch, then wait up to `wait` seconds until every cancelled job is
    confirmed stopped (its stage ended, its sandbox and backend slot freed): `done` says so."""
    svc.store.batch_progress(batch_id)  # 404 for an unknown id
    svc.dispatcher.cancel_batch(batch_id)
    return wait_for_batch(svc, batch_id, wait)


def wait_for_batch(svc: Services, batch_id: str, wait: float) -> BatchProgress:
    """The batch's progress once it is done, or as it is after `wait` seconds."""
    deadline = time.monotonic() + min(wait, svc.settings.max_wait_seconds)
    while not svc.store.batch_done(batch_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    return svc.store.batch_progress(batch_id)


def batch_progress(svc: Services, batch_id: str) -> BatchProgress:
    """`GET /v1/batches/{id}`; an unfinished batch also gets what a worker that died left
    undone picked up (see `Dispatcher.recover`)."""
    progress = svc.store.batch_progress(batch_id)
    if not progress.done and (progress.dynamic is not None or progress.finished >= progress.total):
        recover_batch(svc, batch_id)
        progress = svc.store.batch_progress(batch_id)
    return progress


def recover_batch(svc: Services, batch_id: str) -> None:
    """Pick up what a worker that died left undone of the batch (`Dispatcher.recover`)."""
    # past the longest hard time limit every stage of a cancelled job has been killed
    svc.dispatcher.recover(batch_id, stuck_after=svc.settings.longest_hard_limit + 60.0)


def wait_for_job(svc: Services, job_id: str, timeout: float) -> Trajectory:
    """The job's trajectory once it has finished, or as it is after `timeout` seconds."""
    svc.store.wait(job_id, min(timeout, svc.settings.max_wait_seconds))
    return deliver(svc, job_id)


def deliver(svc: Services, job_id: str) -> Trajectory:
    """The job's trajectory as the caller gets it; a finished one counts as delivered, so its
    record leaves Redis soon (later reads find it in the results store)."""
    trajectory = svc.store.trajectory(job_id)
    if trajectory.status.terminal:
        svc.store.delivered(job_id)
    return trajectory


def resume_point(svc: Services, batch_id: str, after: str | None) -> str | None:
    """The stream entry id that `?after=` points at (None without it); a 422 naming `after`
    for a cursor that is malformed, of another batch, or names no line of this batch."""
    if after is None:
        return None
    try:
        entry_id = parse_cursor(batch_id, after)
    except CursorError as exc:
        raise RequestError(422, str(exc), ["query", "after"]) from None
    if not svc.store.has_result_entry(batch_id, entry_id):
        raise RequestError(
            422, f"the cursor {after!r} names no line of this batch's results", ["query", "after"]
        )
    return entry_id


def result_line(batch_id: str, entry_id: str, trajectory: Trajectory) -> bytes:
    """One NDJSON line of the results stream: the trajectory's fields and its `cursor`."""
    body = trajectory.model_dump_json().encode()
    cursor = json.dumps(make_cursor(batch_id, entry_id)).encode()
    return body[:-1] + b',"cursor":' + cursor + b"}\n"
