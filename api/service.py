"""What the gateway does, as plain functions over the job store, the backend pool and Celery."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from api.schemas import (
    AgentParams,
    BatchProgress,
    BatchRequest,
    RolloutRequest,
    SamplingParams,
    Task,
    Trajectory,
)
from broker.dapo import submit_dynamic
from broker.dispatch import Dispatcher, DispatchError
from broker.jobstore import DynamicOptions, JobSpec, JobStore, PoolTask
from broker.settings import Settings
from routing.pool import BackendPool
from workers.handlers.base import TaskValidationError
from workers.handlers.registry import UnknownDataSource, get_handler, known_handlers

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
            self.store, self.pool, self.celery, self.settings.node_name, self.settings.cancel_grace
        ).install()


def instance_id_of(task: Task) -> str:
    """The task's own id, or a stable one from its content."""
    if task.instance_id:
        return task.instance_id
    digest = hashlib.sha1(json.dumps(task.model_dump(), sort_keys=True).encode()).hexdigest()
    return f"{task.data_source}-{digest[:12]}"


def validate_task(task: Task, loc: Sequence[str | int]) -> None:
    """Check the handler exists and accepts the task; raise a RequestError naming the field."""
    try:
        handler = get_handler(task.data_source)
    except UnknownDataSource:
        known = ", ".join(known_handlers())
        raise RequestError(
            422, f"unknown data_source {task.data_source!r}; known: {known}", [*loc, "data_source"]
        ) from None
    try:
        handler.validate(task.model_dump())
    except TaskValidationError as exc:
        raise RequestError(422, exc.message, [*loc, *exc.field.split(".")]) from None


def resolve_sampling(sampling: SamplingParams, settings: Settings) -> dict[str, Any]:
    data = sampling.model_dump()
    if data["max_tokens"] is None:
        data["max_tokens"] = settings.max_tokens
    return data


def resolve_agent(agent: AgentParams, settings: Settings) -> dict[str, Any]:
    return {
        "max_turns": agent.max_turns or settings.max_turns,
        "max_total_tokens": agent.max_total_tokens or settings.max_total_tokens,
    }


def _require_backend(svc: Services) -> None:
    if svc.pool.count() == 0:
        raise RequestError(
            503,
            "no inference backend is registered: POST /v1/backends "
            '{"url": "http://host:8000", "kind": "vllm", "model": "..."} first',
        )


def _enqueue(svc: Services, specs: list[JobSpec], batch_id: str | None, group_size: int) -> None:
    try:
        svc.dispatcher.enqueue_specs(specs, batch_id, group_size)
    except DispatchError as exc:
        raise RequestError(503, str(exc)) from exc


def submit_rollout(svc: Services, request: RolloutRequest) -> str:
    """Validate and enqueue one job; returns its id."""
    validate_task(request.task, ["body", "task"])
    _require_backend(svc)
    spec = JobSpec(
        task=request.task.model_dump(),
        data_source=request.task.data_source,
        instance_id=instance_id_of(request.task),
        sampling=resolve_sampling(request.sampling, svc.settings),
        agent=resolve_agent(request.agent, svc.settings),
        group_id=uuid.uuid4().hex,
    )
    _enqueue(svc, [spec], None, 1)
    return spec.job_id


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


def submit_batch(svc: Services, request: BatchRequest) -> tuple[str, list[str]]:
    """Validate every task first, then write and enqueue `group_size` jobs per task (with
    dynamic sampling: the first `max_inflight_groups` groups drawn from the tasks)."""
    dynamic = resolve_dynamic(request)
    for index, task in enumerate(request.tasks):
        validate_task(task, ["body", "tasks", index])
    _require_backend(svc)
    batch_id = uuid.uuid4().hex
    sampling = resolve_sampling(request.sampling, svc.settings)
    agent = resolve_agent(request.agent, svc.settings)
    if dynamic is not None:
        pool = [
            PoolTask(task=t.model_dump(), data_source=t.data_source, instance_id=instance_id_of(t))
            for t in request.tasks
        ]
        try:
            jobs = submit_dynamic(svc.dispatcher, batch_id, pool, dynamic, sampling, agent)
        except DispatchError as exc:
            raise RequestError(503, str(exc)) from exc
        return batch_id, jobs
    specs: list[JobSpec] = []
    for task in request.tasks:
        group_id = uuid.uuid4().hex
        instance_id = instance_id_of(task)
        for sample in range(request.group_size):
            specs.append(
                JobSpec(
                    task=task.model_dump(),
                    data_source=task.data_source,
                    instance_id=instance_id,
                    sampling=sampling,
                    agent=agent,
                    group_id=group_id,
                    sample_index=sample,
                    batch_id=batch_id,
                )
            )
    _enqueue(svc, specs, batch_id, request.group_size)
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
        _recover(svc, batch_id)
        progress = svc.store.batch_progress(batch_id)
    return progress


def _recover(svc: Services, batch_id: str) -> None:
    # past the longest hard time limit every stage of a cancelled job has been killed
    svc.dispatcher.recover(batch_id, stuck_after=svc.settings.longest_hard_limit + 60.0)


def wait_for_job(svc: Services, job_id: str, timeout: float) -> Trajectory:
    """The job's trajectory once it has finished, or as it is after `timeout` seconds."""
    svc.store.wait(job_id, min(timeout, svc.settings.max_wait_seconds))
    return svc.store.trajectory(job_id)


def stream_results(svc: Services, batch_id: str) -> Iterator[bytes]:
    """NDJSON lines: every finished trajectory of the batch as it finishes (for a dynamic batch:
    the jobs of each accepted group as it is accepted, ending once the batch is done); a blank
    keep-alive line after each second without news."""
    dynamic = svc.store.is_dynamic(batch_id)
    idle = 0
    for job_id in svc.store.iter_finished(batch_id):
        if job_id is None:
            idle += 1
            if dynamic and idle % 10 == 0:
                _recover(svc, batch_id)
            yield b"\n"
            continue
        yield svc.store.trajectory(job_id).model_dump_json().encode() + b"\n"
