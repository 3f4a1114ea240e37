"""Outliving Redis: the embedded one comes back from a SIGKILL with every record, clients
retry a lost connection, and a worker that loses the broker for good exits."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import redis

from broker.connections import BACKOFF_BASE, BACKOFF_CAP, retries_for
from broker.embedded import APPEND_DIR, EmbeddedRedis
from broker.jobstore import JobStore
from broker.processes import spawn, stop_group
from core.schemas import BackendSpec, JobStatus
from routing.pool import BackendPool
from tests.support.jobs import make_specs
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]


def kill_hard(server: EmbeddedRedis) -> None:
    """SIGKILL the server and wait until it is gone (no shutdown, no final write)."""
    assert server.pid is not None
    os.killpg(server.pid, signal.SIGKILL)
    wait_until(lambda: server.poll() is not None, 10, "the killed Redis to end")


def test_a_killed_server_restarts_on_its_port_with_every_record(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", maxmemory="128mb")
    try:
        url = server.start()
        client = redis.Redis.from_url(url)
        store, pool = JobStore(client, prefix="t:"), BackendPool(client, "t:")
        specs = make_specs(2, 2)
        store.create_jobs(specs, batch_id="b1", group_size=2)
        finished = specs[0].job_id
        store.transition(finished, JobStatus.run)
        trajectory = store.trajectory(finished)
        trajectory.reward = 1.0
        assert store.finish(finished, JobStatus.completed, trajectory)
        pool.register(BackendSpec(url="http://127.0.0.1:9", model="m", id="gpu-0"))
        # appendfsync everysec: wait for the next fsync rather than a second.
        assert client.execute_command("WAITAOF", 1, 0, 5000)[0] == 1

        kill_hard(server)
        assert server.start() == url  # same port, same password
        assert (tmp_path / "redis" / APPEND_DIR).is_dir()

        # The old client reconnects by itself.
        assert store.status(finished) is JobStatus.completed
        assert store.trajectory(finished).reward == 1.0
        assert store.status(specs[1].job_id) is JobStatus.queued
        progress = store.batch_progress("b1")
        assert (progress.total, progress.finished) == (4, 1)
        assert client.xlen("t:batch:b1:done") == 1
        backend = pool.get("gpu-0")
        assert backend is not None and backend.url == "http://127.0.0.1:9"
        # Exactly once still holds after the restart.
        assert not store.finish(finished, JobStatus.failed)
    finally:
        server.stop()


def test_retries_cover_the_patience_asked_for() -> None:
    for patience in (0.0, 2.0, 30.0):
        retries = retries_for(patience)
        waits = [min(BACKOFF_CAP, BACKOFF_BASE * 2**n) for n in range(1, retries + 1)]
        assert retries >= 1 and sum(waits) >= patience
        assert sum(waits[:-1]) < patience or retries == 1


def test_a_worker_that_loses_the_broker_for_good_exits_with_an_error(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", maxmemory="128mb")
    worker = None
    try:
        url = server.start()
        env = {
            **os.environ,
            "ROLLSERVE_REDIS_URL": url,
            "ROLLSERVE_DATA_DIR": str(tmp_path),
            "ROLLSERVE_SANDBOX_DIR": str(tmp_path / "sandboxes"),
            "ROLLSERVE_BROKER_CONNECTION_MAX_RETRIES": "1",
        }
        argv = [
            sys.executable, "-m", "celery", "-A", "broker.worker_app", "worker", "-Q", "run",
            "-P", "prefork", "-c", "1", "-n", "lost@test", "--without-gossip", "--without-mingle",
            "--loglevel", "INFO",
        ]  # fmt: skip
        log_path = tmp_path / "worker.log"
        worker = spawn(argv, env=env, log_path=str(log_path), cwd=str(REPO))
        wait_until(lambda: b" ready." in log_path.read_bytes(), 60, "the worker to be ready")
        kill_hard(server)
        assert worker.wait(timeout=120) != 0
        assert b"Unrecoverable error" in log_path.read_bytes()
    finally:
        if worker is not None:
            stop_group(worker)
        server.stop()
