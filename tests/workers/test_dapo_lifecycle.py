"""The worker side of a cancelled job's stop, against a real Redis: stage marks around a stage
task, the `task_revoked` handler that confirms a killed or dropped stage, and the broadcast
that releases a sandbox on its node."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from broker.celery_app import create_celery
from broker.jobstore import JobSpec, JobStore
from core.schemas import JobStatus
from core.settings import Settings
from routing.pool import BackendPool
from sandbox.procs import process_start_time
from workers import lifecycle
from workers.process_state import Runtime


@pytest.fixture
def lifecycle_rt(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, node_name="node-a")
    app = create_celery(settings, redis_url)
    runtime = Runtime(
        settings=settings, store=JobStore(client), pool=BackendPool(client), celery=app
    )
    monkeypatch.setattr(lifecycle, "get_runtime", lambda: runtime)
    yield runtime
    app.close()
    client.close()


def batch_job(store: JobStore, batch_id: str = "p") -> str:
    spec = JobSpec(
        task={"data_source": "math", "problem": "1+1"},
        data_source="math",
        instance_id="t",
        sampling={},
        agent={},
        group_id="g",
        batch_id=batch_id,
    )
    store.create_jobs([spec], batch_id=batch_id, group_size=1)
    store.transition(spec.job_id, JobStatus.init)
    return spec.job_id


def fake_task(job_id: str, stage: str, app: Any) -> Any:
    return SimpleNamespace(app=app, request=SimpleNamespace(id=f"{job_id}-{stage}", chain=["x"]))


def test_a_stage_runs_between_its_marks_and_none_starts_for_an_ended_job(
    lifecycle_rt: Runtime, redis_url: str
) -> None:
    app = create_celery(lifecycle_rt.settings, redis_url)
    job_id = batch_job(lifecycle_rt.store)
    seen: list[tuple[str, str] | str | None] = []
    task = fake_task(job_id, "init", app)
    lifecycle.tracked(task, job_id, lambda: seen.append(lifecycle_rt.store.active_stage(job_id)))
    [active] = seen
    assert isinstance(active, tuple)
    assert active[0] == f"{job_id}-init" and active[1].startswith(f"node-a|{os.getpid()}|")
    assert lifecycle_rt.store.active_stage(job_id) is None
    lifecycle_rt.finish(job_id, JobStatus.cancelled)
    later = fake_task(job_id, "run", app)
    lifecycle.tracked(later, job_id, lambda: seen.append("ran"))
    assert "ran" not in seen and later.request.chain is None
    app.close()


def test_a_killed_stage_is_confirmed_once_its_process_is_gone(lifecycle_rt: Runtime) -> None:
    job_id = batch_job(lifecycle_rt.store)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        where = f"node-a|{child.pid}|{process_start_time(child.pid)}"
        assert lifecycle_rt.store.stage_begin(job_id, f"{job_id}-init", where)
        lifecycle_rt.store.finish(job_id, JobStatus.cancelled)
        assert lifecycle_rt.store.stopping("p") == {job_id}
        threading.Timer(0.2, child.kill).start()  # what revoke(terminate=True) does
        request = SimpleNamespace(id=f"{job_id}-init", args=[job_id])
        lifecycle.on_revoked(sender=None, request=request, terminated=True)
        assert child.poll() is not None  # it waited for the process
    finally:
        child.kill()
        child.wait()
    assert lifecycle_rt.store.active_stage(job_id) is None
    assert lifecycle_rt.store.stopping("p") == set() and lifecycle_rt.store.batch_done("p")


def test_a_stage_that_unwinds_itself_is_confirmed_without_its_process_exiting(
    lifecycle_rt: Runtime,
) -> None:
    job_id = batch_job(lifecycle_rt.store)
    where = lifecycle.where(lifecycle_rt)  # this very process stays alive
    assert lifecycle_rt.store.stage_begin(job_id, f"{job_id}-run", where)
    lifecycle_rt.store.finish(job_id, JobStatus.cancelled)
    threading.Timer(0.1, lambda: lifecycle_rt.store.stage_end(job_id, f"{job_id}-run")).start()
    request = SimpleNamespace(id=f"{job_id}-run")  # no args: the job comes from the task id
    lifecycle.on_revoked(sender=None, request=request, terminated=True)
    assert lifecycle_rt.store.batch_done("p")


def test_a_dropped_stage_of_a_job_with_a_box_elsewhere_waits_for_that_node(
    lifecycle_rt: Runtime,
) -> None:
    job_id = batch_job(lifecycle_rt.store)
    box = {"host": "node-b", "keeper_pid": 1, "job_id": job_id}
    lifecycle_rt.store.set_fields(job_id, sandbox=box)
    lifecycle_rt.store.finish(job_id, JobStatus.cancelled)
    lifecycle.on_revoked(sender=None, request=SimpleNamespace(id=f"{job_id}-run"))
    assert lifecycle_rt.store.stopping("p") == {job_id}  # not this node's box
    lifecycle.rollserve_release(None, [job_id])
    assert lifecycle_rt.store.stopping("p") == {job_id}
    lifecycle_rt.settings.node_name = "node-b"  # the box's node answers the broadcast
    assert lifecycle.rollserve_release(None, [job_id]) == {"ok": "released 1 sandbox(es)"}
    assert lifecycle_rt.store.batch_done("p")


def test_other_tasks_are_ignored(lifecycle_rt: Runtime) -> None:
    lifecycle.on_revoked(sender=SimpleNamespace(name="other.task"), request=None)
    assert lifecycle.job_of_request(SimpleNamespace(id="not-a-stage")) is None
