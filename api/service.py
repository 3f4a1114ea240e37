"""What the gateway does, as plain functions over the job store, the backend pool and Celery."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from api.schemas import (
    AgentParams,
    BatchProgress,
    BatchRequest,
    JobStatus,
    RolloutRequest,
    SamplingParams,
    StageError,
    Task,
    Trajectory,
)
from broker.celery_app import job_chain
from broker.jobstore import JobSpec, JobStore
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
    svc.store.create_jobs(specs, batch_id=batch_id, group_size=group_size)
    try:
        with svc.celery.producer_or_acquire() as producer:
            for spec in specs:
                job_chain(svc.celery, spec.job_id, spec.task_ids).apply_async(producer=producer)
    except Exception as exc:
        log.exception("enqueueing %d jobs failed", len(specs))
        svc.store.delete_jobs(specs, batch_id)
        raise RequestError(503, f"the broker did not take the jobs: {exc}") from exc


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


def submit_batch(svc: Services, request: BatchRequest) -> tuple[str, list[str]]:
    """Validate every task first, then write and enqueue `group_size` jobs per task."""
    if request.dynamic_sampling is not None:
        raise RequestError(
            422,
            "dynamic sampling is not available in this version; send null",
            ["body", "dynamic_sampling"],
        )
    for index, task in enumerate(request.tasks):
        validate_task(task, ["body", "tasks", index])
    _require_backend(svc)
    batch_id = uuid.uuid4().hex
    sampling = resolve_sampling(request.sampling, svc.settings)
    agent = resolve_agent(request.agent, svc.settings)
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
    """Cancel the live jobs among `job_ids`: record them cancelled, revoke tasks, free backends.

    Returns how many were cancelled by this call (finished jobs are left as they are).
    """
    revoke: list[str] = []
    cancelled = 0
    for job_id in job_ids:
        record = svc.store.get(job_id)
        if record.status.terminal:
            continue
        error = StageError(
            stage=record.status.value, type="cancelled", message="cancelled by request"
        )
        if svc.store.finish(job_id, JobStatus.cancelled, error=error):
            cancelled += 1
            revoke.extend(record.task_ids.values())
            svc.pool.release(job_id)
    if revoke:
        # A running stage is killed; queued ones are dropped when a worker receives them.
        svc.celery.control.revoke(revoke, terminate=True, signal="SIGTERM")
    return cancelled


def cancel_batch(svc: Services, batch_id: str) -> BatchProgress:
    cancel_jobs(svc, svc.store.batch_job_ids(batch_id))
    return svc.store.batch_progress(batch_id)


def wait_for_job(svc: Services, job_id: str, timeout: float) -> Trajectory:
    """The job's trajectory once it has finished, or as it is after `timeout` seconds."""
    svc.store.wait(job_id, min(timeout, svc.settings.max_wait_seconds))
    return svc.store.trajectory(job_id)


def stream_results(svc: Services, batch_id: str) -> Iterator[bytes]:
    """NDJSON lines: every finished trajectory of the batch as it finishes; a blank keep-alive
    line after each second without news."""
    for job_id in svc.store.iter_finished(batch_id):
        if job_id is None:
            yield b"\n"
            continue
        yield svc.store.trajectory(job_id).model_dump_json().encode() + b"\n"
