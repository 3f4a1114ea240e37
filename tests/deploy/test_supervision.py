"""The stack's supervisor: a child that dies is logged and started again, with backoff."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from api.client import RolloutClient
from broker.processes import free_port, spawn, stop_group
from core.schemas import JobStatus
from core.settings import Settings
from deploy.stack import Stack, StackOptions
from deploy.supervisor import Backoff, Supervisor, describe_exit
from tests.support.procs import processes_mentioning
from tests.support.stack import start_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

REPO = Path(__file__).resolve().parents[2]
SCRIPT = [{"match": "ADD", "samples": [["So 2+2 = \\boxed{4}."]]}]
MISSING = f"/v1/batches/{'0' * 32}"
TASK = {"data_source": "math", "instance_id": "add", "problem": "ADD: 2+2?", "answer": "4"}


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(first=0.5, cap=4.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_exits_are_named_by_code_or_signal() -> None:
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


def test_a_child_that_keeps_dying_is_reported_loudly_and_retried_at_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    restarts: list[str] = []
    supervisor = Supervisor(
        dead=lambda: {"gateway": 3},  # dies again at once after every restart
        restart=restarts.append,
        backoff=Backoff(first=0.01, cap=0.04, loud_after=3),
        interval=0.01,
    )
    with caplog.at_level(logging.WARNING, logger="deploy.supervisor"):
        supervisor.start()
        wait_until(lambda: len(restarts) >= 5, 30, "five restarts")
        supervisor.stop()
    done = len(restarts)
    assert set(restarts) == {"gateway"}
    messages = [r.getMessage() for r in caplog.records]
    assert any("gateway died (exit code 3); restart attempt 1" in m for m in messages)
    loud = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert loud and "gateway keeps dying" in loud[0].getMessage()
    assert len(restarts) == done  # stopped: no more restarts


def test_a_killed_gateway_and_worker_come_back_and_the_stack_serves(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    caplog.set_level(logging.WARNING, logger="deploy.supervisor")
    stack = start_stack(
        data, tiny_model_dir, script=SCRIPT, workers={"init": 1, "run": 1, "eval": 1}
    )
    try:
        gateway = stack.children["gateway"]
        run_worker = next(n for n in stack.children if n.startswith("worker-run"))
        worker = stack.children[run_worker]
        os.kill(gateway.pid, signal.SIGKILL)
        os.kill(worker.pid, signal.SIGKILL)  # the main process only: its pool is reaped
        wait_until(lambda: stack.children["gateway"] is not gateway, 60, "a new gateway")
        wait_until(lambda: stack.children[run_worker] is not worker, 60, "a new run worker")
        stack.wait_ready(120)
        with RolloutClient(stack.gateway_url, timeout=60) as client:
            job_id = client.submit_rollout(TASK)
            assert isinstance(job_id, str)
            wait_until(
                lambda: client.get_rollout(job_id).status is JobStatus.completed,
                180,
                "the job to complete on the restarted stack",
            )
            assert client.get_rollout(job_id).reward == 1.0
        assert httpx.get(f"{stack.gateway_url}/healthz").status_code == 200
        messages = [r.getMessage() for r in caplog.records]
        assert any("gateway died (signal SIGKILL)" in m for m in messages), messages
        assert any(f"{run_worker} died (signal SIGKILL)" in m for m in messages), messages
        assert any(f"restarted {run_worker}" in m for m in messages), messages
    finally:
        stack.stop()
    assert processes_mentioning(str(data)) == []


def test_while_redis_is_down_the_gateway_answers_503_naming_it_then_recovers(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    settings = Settings(data_dir=data, port=free_port())
    # A long first backoff keeps Redis down for a while after the kill.
    options = StackOptions(workers={}, restart_backoff=Backoff(first=10.0))
    with Stack(settings, options) as stack, httpx.Client(base_url=stack.gateway_url) as http:
        assert http.get(MISSING).status_code == 404
        assert stack.redis is not None and stack.redis.pid is not None
        os.killpg(stack.redis.pid, signal.SIGKILL)
        answer = http.get(MISSING, timeout=30)
        assert answer.status_code == 503, answer.text
        assert "Redis" in answer.json()["detail"]
        assert http.get("/healthz", timeout=30).json()["redis"] is False
        # The same gateway process answers again once the supervisor has restarted Redis.
        wait_until(
            lambda: http.get(MISSING, timeout=30).status_code == 404,
            120,
            "the gateway to reach the restarted Redis",
        )
    assert processes_mentioning(str(data)) == []


def test_rollserve_worker_exits_non_zero_when_the_broker_stays_away(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ROLLSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
        "ROLLSERVE_DATA_DIR": str(tmp_path),
        "ROLLSERVE_SANDBOX_DIR": str(tmp_path / "sandboxes"),
        "ROLLSERVE_BROKER_CONNECTION_MAX_RETRIES": "1",
        "ROLLSERVE_REDIS_RETRY_SECONDS": "1",  # the first heartbeat gives up at once too
    }
    argv = [sys.executable, "-m", "deploy.cli", "worker", "run", "--concurrency", "1"]
    worker = spawn(argv, env=env, log_path=str(tmp_path / "worker.log"), cwd=str(REPO))
    try:
        assert worker.wait(timeout=120) != 0  # for systemd's Restart=on-failure
    finally:
        stop_group(worker)
