"""A training run survives its own infrastructure, end to end on a real stack: a run worker
whose main process is SIGKILLed mid-batch has its stages taken over by the sweeper long
before Redis's visibility timeout, a stage stuck past its hard limit ends `timed_out`, and a
job's time budget (`agent.max_seconds`) stops its episode.

The heartbeat and sweep settings are the defaults (the only stack of the suite on them; the
others take over a dead worker's stages on short timers); the visibility timeout is 15
minutes, so only the sweeper can bring the lost jobs back within the test's patience.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from api.client import RolloutClient
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.stack import PRODUCTION_TIMERS
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

SCRIPT = [
    {"match": "STEADY", "samples": [["Carefully: \\boxed{6}"]], "delay": 4.0},
    {"match": "STUCK", "samples": [["\\boxed{1}"]], "delay": 5.0},
    {"match": "DAWDLE", "samples": [["Hmm, let me think again."] * 8], "delay": 1.0},
]
VISIBILITY_TIMEOUT = 900.0


def math_task(marker: str, answer: str, n: int = 0) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": f"{marker.lower()}-{n}",
        "problem": f"{marker} {n}: what is the answer?",
        "answer": answer,
    }


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"script": SCRIPT, "visibility_timeout": VISIBILITY_TIMEOUT, **PRODUCTION_TIMERS}


def job_fields(r: redis.Redis, job_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(f"rs:job:{job_id}").items()}


def holder_pid(fields: dict[str, str]) -> int | None:
    """The main process pid of the worker holding the job's stage (from `active_owner`)."""
    parts = fields.get("active_owner", "").split("|")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def test_a_killed_run_workers_jobs_complete_once_well_before_the_visibility_timeout(
    client: RolloutClient, stack: Stack
) -> None:
    second = stack.start_worker("run", 2)
    stack.wait_worker(second)
    r = redis.Redis.from_url(stack.redis_url)
    accepted = client.submit_batch([math_task("STEADY", "6", n) for n in range(8)], group_size=1)
    run_workers = {
        stack.children[n].pid: n for n in stack.worker_names if n.startswith("worker-run")
    }
    assert len(run_workers) == 2

    def held_by() -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        for job_id in accepted.jobs:
            fields = job_fields(r, job_id)
            pid = holder_pid(fields)
            if fields.get("status") == "run" and pid in run_workers:
                found.setdefault(pid, []).append(job_id)
        return found

    wait_until(lambda: held_by(), 60, "a run worker to hold a job")
    victim_pid, lost = max(held_by().items(), key=lambda item: len(item[1]))
    killed_at = time.monotonic()
    stack.kill_worker(run_workers[victim_pid], signal.SIGKILL)

    wait_until(lambda: client.batch_progress(accepted.batch_id).done, 180, "the batch to end")
    recovered = time.monotonic() - killed_at
    results = list(client.iter_batch_results(accepted.batch_id))
    print(f"\n{len(lost)} lost job(s) completed {recovered:.1f}s after their worker was killed")
    assert recovered < VISIBILITY_TIMEOUT
    assert sorted(t.job_id for t in results) == sorted(accepted.jobs)
    ends = [(t.status, t.reward, t.error) for t in results]
    assert ends == [(JobStatus.completed, 1.0, None)] * len(accepted.jobs)
    assert r.xlen(f"rs:batch:{accepted.batch_id}:done") == len(accepted.jobs)
    progress = client.batch_progress(accepted.batch_id)
    assert (progress.finished, progress.counts.get("completed")) == (8, 8)
    for job_id in lost:
        assert job_fields(r, job_id)["attempt"] == "1"
    assert all(b.in_flight == 0 for b in client.list_backends())
    assert r.zcard("rs:held") == 0


def test_a_stage_stuck_past_its_hard_limit_ends_timed_out(
    client: RolloutClient, stack: Stack
) -> None:
    job_id = client.submit_rollout(math_task("STUCK", "1"))
    assert isinstance(job_id, str)
    r = redis.Redis.from_url(stack.redis_url)
    wait_until(lambda: job_fields(r, job_id).get("status") == "run", 30, "the job to run")
    # Its pool process stops answering signals: the soft limit cannot interrupt it, and
    # Celery kills it at the hard limit without a word to the job store.
    pool_pid = int(job_fields(r, job_id)["active_at"].split("|")[1])
    os.kill(pool_pid, signal.SIGSTOP)
    wait_until(lambda: client.get_rollout(job_id).status.terminal, 120, "the job to end")
    traj = client.get_rollout(job_id)
    assert traj.status is JobStatus.timed_out
    assert traj.error is not None and (traj.error.stage, traj.error.type) == ("run", "timeout")
    assert "hard limit" in traj.error.message
    # The sweeper records the end, then frees what the job held: a moment apart.
    wait_until(
        lambda: all(b.in_flight == 0 for b in client.list_backends()), 10, "its backend slot freed"
    )


def test_the_time_budget_stops_the_episode(client: RolloutClient) -> None:
    traj = client.submit_rollout(
        math_task("DAWDLE", "3"), agent={"max_seconds": 2.5}, wait=True, timeout=60
    )
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed  # graded as usual
    assert (traj.stop_reason, traj.truncated) == ("time_budget", True)
    assert 1 <= len([t for t in traj.turns if t.type == "model"]) < 8
    assert traj.reward == 0.0


def test_a_stage_message_lost_in_transit_is_sent_again(client: RolloutClient, stack: Stack) -> None:
    r = redis.Redis.from_url(stack.redis_url)
    for name in [n for n in stack.worker_names if n.startswith("worker-run")]:
        if name in stack.children:
            stack.kill_worker(name, signal.SIGKILL)
    job_id = client.submit_rollout(math_task("STEADY", "6", 99))
    assert isinstance(job_id, str)
    wait_until(lambda: r.llen("run") == 1, 60, "INIT to end and send the RUN message")
    # A run worker takes the message from Redis and is killed before it notes it anywhere.
    lost_at = time.monotonic()
    assert r.rpop("run") is not None
    stack.wait_worker(stack.start_worker("run", 1))
    wait_until(lambda: client.get_rollout(job_id).status.terminal, 180, "the job to end")
    print(
        f"\nthe lost RUN message was sent again; job done {time.monotonic() - lost_at:.1f}s later"
    )
    traj = client.get_rollout(job_id)
    assert (traj.status, traj.reward, traj.error) == (JobStatus.completed, 1.0, None)
    assert job_fields(r, job_id)["attempt"] == "1"
    assert r.llen("run") == 0 and r.zcard("rs:transit") == 0
