"""The three stages as plain functions of (runtime, job id); each returns whether the job goes on.

They are written to be run twice: a redelivered stage redoes its work, and only the first
final result is recorded (the job store's `finish` is exactly-once).
"""

from __future__ import annotations

import time
from typing import Any

from api.schemas import JobStatus
from broker.jobstore import JobRecord
from workers.agent import Limits, run_episode
from workers.handlers.registry import get_handler
from workers.runtime import Runtime
from workers.trajectory import TrajectoryBuilder


def _enter(rt: Runtime, job_id: str, status: JobStatus) -> JobRecord | None:
    record = rt.store.get(job_id)
    if record.status.terminal:
        return None
    rt.store.transition(job_id, status)
    return record


def init_stage(rt: Runtime, job_id: str) -> bool:
    """Prepare the episode: the handler's first messages and tools, kept in the job record."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.init)
    if record is None:
        return False
    handler = get_handler(record.data_source)
    context = {
        "messages": handler.initial_messages(record.task),
        "tools": handler.tools(record.task),
    }
    rt.store.set_fields(job_id, context=context)
    rt.store.stage_finished(job_id, "init", time.perf_counter() - started)
    return True


def limits_for(record: JobRecord) -> Limits:
    """The episode's bounds from the job's resolved sampling and agent parameters."""
    sampling: dict[str, Any] = record.sampling
    seed = sampling.get("seed")
    return Limits(
        max_turns=int(record.agent["max_turns"]),
        max_total_tokens=int(record.agent["max_total_tokens"]),
        max_tokens=int(sampling["max_tokens"]),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        seed=None if seed is None else int(seed) + record.sample_index,
        stop=sampling.get("stop"),
    )


def run_stage(rt: Runtime, job_id: str) -> bool:
    """Run the agent loop on the job's backend, saving the trajectory after every turn."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.run)
    if record is None:
        return False
    if record.context is None:
        raise RuntimeError("the job reached RUN without the context INIT prepares")
    handler = get_handler(record.data_source)
    backend = rt.pool.acquire(job_id)
    try:
        rt.store.set_fields(job_id, backend_id=backend.id, policy_version=backend.policy_version)
        trajectory = rt.store.skeleton(record)
        trajectory.backend_id = backend.id
        trajectory.policy_version = backend.policy_version
        trajectory.status = JobStatus.run

        def save(builder: TrajectoryBuilder) -> None:
            rt.store.save_partial(job_id, builder.fill(trajectory))

        client, templater = rt.policy(backend)
        episode = rt.run(
            run_episode(
                handler,
                record.task,
                record.context["messages"],
                record.context.get("tools"),
                client,
                templater,
                limits_for(record),
                on_turn=save,
            )
        )
        episode.builder.fill(trajectory)
        trajectory.stop_reason = episode.stop_reason
        trajectory.truncated = episode.truncated
        rt.store.save_partial(job_id, trajectory)
    finally:
        rt.pool.release(job_id)
    rt.store.stage_finished(job_id, "run", time.perf_counter() - started)
    return True


def eval_stage(rt: Runtime, job_id: str) -> bool:
    """Grade the episode and record the job as completed (once)."""
    started = time.perf_counter()
    record = _enter(rt, job_id, JobStatus.eval)
    if record is None:
        return False
    handler = get_handler(record.data_source)
    trajectory = rt.store.trajectory(job_id)
    texts = [turn.text for turn in trajectory.turns if turn.type == "model"]
    grade = handler.grade(record.task, texts)
    trajectory.reward = float(grade.reward)
    trajectory.eval = grade.details
    rt.store.stage_finished(job_id, "eval", time.perf_counter() - started)
    rt.store.finish(job_id, JobStatus.completed, trajectory)
    return False
