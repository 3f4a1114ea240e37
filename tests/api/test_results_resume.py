"""The clients resume a results stream that breaks: a gateway killed mid-stream and started
again on the same port, or a network that cuts every connection after a few lines. Real HTTP
throughout; jobs are ended through the job store, as a worker would end them. Each
trajectory must reach the caller exactly once, in the stream's order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from api.client import AsyncRolloutClient, RolloutClient, RolloutServiceError
from broker.jobstore import JobStore
from broker.processes import free_port, spawn, stop_group, wait_for_port
from broker.resultstore import results_store
from core.schemas import JobStatus, Trajectory
from core.settings import Settings
from tests.support.gateway import GOOD_TASK
from tests.support.proxy import cutting_proxy
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess:
    """`uvicorn api.main:app` in its own process group on one port, to kill and start again."""

    def __init__(self, redis_url: str, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / "gateway.log"
        self.env = {
            **os.environ,
            "ROLLSERVE_REDIS_URL": redis_url,
            "ROLLSERVE_DATA_DIR": str(data_dir),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "uvicorn", "api.main:app",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = spawn(argv, env=self.env, cwd=str(ROOT), log_path=str(self.log))
        wait_for_port("127.0.0.1", self.port, 60, self.proc)

    def kill(self) -> None:
        """SIGKILL the whole process group: open connections break without a goodbye."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


@pytest.fixture
def gateway_process(redis_url: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(redis_url, tmp_path)
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture
def store(redis_url: str, tmp_path: Path) -> Iterator[JobStore]:
    """The job store as a worker has it: its results store is the gateway's (the same data
    directory)."""
    client = redis.Redis.from_url(redis_url)
    settings = Settings(data_dir=tmp_path)
    yield JobStore(client, settings.key_prefix, results=results_store(settings))
    client.close()


def end(store: JobStore, job_id: str) -> None:
    store.transition(job_id, JobStatus.init)
    trajectory = store.trajectory(job_id)
    trajectory.reward = 1.0
    assert store.finish(job_id, JobStatus.completed, trajectory)


def submit(client: RolloutClient, jobs: int) -> tuple[str, list[str]]:
    client.register_backend("http://127.0.0.1:9", "m", id="b0", verify=False)
    accepted = client.submit_batch([GOOD_TASK] * jobs)
    return accepted.batch_id, accepted.jobs


def test_a_gateway_killed_mid_stream_and_restarted_loses_and_repeats_nothing(
    gateway_process: GatewayProcess, store: JobStore
) -> None:
    got: list[Trajectory] = []
    failed: list[BaseException] = []
    with RolloutClient(gateway_process.url, timeout=10) as client:
        batch_id, jobs = submit(client, 8)
        for job_id in jobs[:3]:
            end(store, job_id)
        opened: list[httpx.URL] = []
        client._http.event_hooks["request"].append(lambda request: opened.append(request.url))

        def read() -> None:
            try:
                got.extend(client.iter_batch_results(batch_id, resume_for=120))
            except BaseException as exc:
                failed.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wait_until(lambda: len(got) >= 2 or failed, 60, "the first results")
            gateway_process.kill()
            for job_id in jobs[3:6]:
                end(store, job_id)  # while no gateway runs
            gateway_process.start()  # the reader is refused until it listens
            for job_id in jobs[6:]:
                end(store, job_id)
        finally:
            reader.join(timeout=120)
        assert not reader.is_alive(), "the reader did not finish"
    assert failed == []
    assert [t.job_id for t in got] == jobs
    resumed = [url for url in opened if "after" in url.params]
    assert resumed and all(url.path.endswith("/results") for url in resumed)


def test_the_client_gives_up_when_the_gateway_stays_away(
    gateway_process: GatewayProcess, store: JobStore
) -> None:
    got: list[Trajectory] = []
    with RolloutClient(gateway_process.url, timeout=10) as client:
        batch_id, jobs = submit(client, 3)
        end(store, jobs[0])
        stream = client.iter_batch_lines(batch_id, resume_for=0.5)
        first = next(stream)
        gateway_process.kill()
        with pytest.raises(RolloutServiceError) as err:
            got.extend(line.trajectory for line in stream)
    assert first.trajectory.job_id == jobs[0] and got == []
    message = str(err.value)
    assert err.value.status_code is None
    assert f"batch {batch_id}" in message and "could not be resumed within 0.5 s" in message
    assert f"after={first.cursor!r}" in message


def test_the_client_resumes_through_a_network_that_cuts_streams(
    gateway: str, store: JobStore
) -> None:
    with RolloutClient(gateway, timeout=10) as client:
        batch_id, jobs = submit(client, 7)
    for job_id in jobs:
        end(store, job_id)
    with cutting_proxy(gateway, lines=2) as proxy, RolloutClient(proxy.url, timeout=10) as client:
        lines = list(client.iter_batch_lines(batch_id))
        assert proxy.connections >= 4  # every connection broke after two lines
    assert [line.trajectory.job_id for line in lines] == jobs
    with RolloutClient(gateway, timeout=10) as client:  # a cursor kept resumes later, too
        rest = [t.job_id for t in client.iter_batch_results(batch_id, after=lines[4].cursor)]
    assert rest == jobs[5:]


async def test_the_async_client_resumes_through_a_network_that_cuts_streams(
    gateway: str, store: JobStore
) -> None:
    with RolloutClient(gateway, timeout=10) as client:
        batch_id, jobs = submit(client, 5)
    for job_id in jobs:
        end(store, job_id)
    with cutting_proxy(gateway, lines=1) as proxy:
        async with AsyncRolloutClient(proxy.url, timeout=10) as client:
            seen = [t.job_id async for t in client.iter_batch_results(batch_id)]
        assert proxy.connections >= 5
    assert seen == jobs
