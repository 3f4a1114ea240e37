"""The store's data types: what the gateway hands it, what it returns, and its one error."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from core.schemas import STAGES, JobStatus, StageError


class JobNotFound(KeyError):
    """No job (or batch) with that id is known."""


@dataclass
class JobSpec:
    """What the gateway decided for one job before it is enqueued."""

    task: dict[str, Any]
    data_source: str
    instance_id: str
    sampling: dict[str, Any]
    agent: dict[str, Any]
    group_id: str
    sample_index: int = 0
    batch_id: str | None = None
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    task_ids: dict[str, str] = field(default_factory=dict)
    """Celery task id per stage; `{job_id}-{stage}` unless given (a revoked task's job is then
    known from its id alone)."""

    def __post_init__(self) -> None:
        if not self.task_ids:
            self.task_ids = stage_task_ids(self.job_id)


def stage_task_ids(job_id: str) -> dict[str, str]:
    """The Celery task ids of a job's stages."""
    return {stage: f"{job_id}-{stage}" for stage in STAGES}


def job_of_task(task_id: str) -> str | None:
    """The job id in a stage task id made by `stage_task_ids`, or None."""
    job_id, _, stage = task_id.rpartition("-")
    return job_id if job_id and stage in STAGES else None


@dataclass
class FinishOutcome:
    """What recording one job's end set in motion (see the package docstring)."""

    job_id: str
    recorded: bool
    """False when the job had ended already (nothing changed)."""
    batch_id: str | None = None
    event: str = ""
    """`target`: this end completed the group that met a dynamic batch's target, and the
    caller must cancel the rest of the batch; `done`: the batch ended without that."""
    new_jobs: list[str] = field(default_factory=list)
    """Jobs of groups drawn to refill the batch: created, not yet sent to Celery."""


@dataclass
class PoolTask:
    """One task of a dynamic batch's pool, as the gateway validated it."""

    task: dict[str, Any]
    data_source: str
    instance_id: str


@dataclass
class DynamicOptions:
    """Resolved dynamic-sampling options of a batch."""

    target_groups: int
    group_size: int
    max_inflight_groups: int
    max_attempts_per_task: int
    early_cancel: bool = True


@dataclass
class JobRecord:
    """A job as the store holds it."""

    job_id: str
    status: JobStatus
    task: dict[str, Any]
    data_source: str
    instance_id: str
    group_id: str
    sample_index: int
    batch_id: str | None
    sampling: dict[str, Any]
    agent: dict[str, Any]
    task_ids: dict[str, str]
    created_at: float
    times: dict[str, float]
    durations: dict[str, float]
    backend_id: str | None
    policy_version: int | None
    error: StageError | None
    context: dict[str, Any] | None
    sandbox: dict[str, Any] | None
    """Where the job's sandbox lives (its keeper, socket and host), once INIT started it."""
    hosts: dict[str, str]
    """The node that ran each stage (the last one, if a stage ran twice)."""
    result: str | None = None
    """Where the results store keeps the finished trajectory, once it moved there."""
    attempt: int = 0
    """Times a stage of the job was taken over from a worker that stopped (0: never)."""
