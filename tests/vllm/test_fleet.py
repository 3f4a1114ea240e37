"""The fleet on real engines: a weight update (drain, then resume with a new policy version)
in the middle of a job, and a second server killed mid-batch while the real vLLM carries the
jobs it stranded (the second is the development server: it speaks vLLM's API, and the session
starts one vLLM)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from api.client import RolloutClient
from core.schemas import JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from routing.pool import BackendPool
from tests.support.devserver import DevBackend
from tests.support.wait import wait_until
from tests.vllm.conftest import (
    SHELL_TASK,
    VllmServer,
    engine_metrics,
    registered,
)

pytestmark = pytest.mark.vllm

SAMPLING = {"temperature": 1.0, "max_tokens": 48, "seed": 3}


def math_task(n: int) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": f"fleet-{n}",
        "problem": f"Fleet {n}: what is {n} + {n}? Think it through step by step first.",
        "answer": str(2 * n),
    }


def model_turns(traj: Trajectory) -> list[ModelTurn]:
    return [t for t in traj.turns if isinstance(t, ModelTurn)]


@pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)
def test_a_weight_update_mid_job_waits_then_records_the_new_version(
    stack: Stack, vllm_server: VllmServer
) -> None:
    with (
        registered(
            stack, vllm_server.url, vllm_server.model, api="completions", backend_id="update",
            policy_version=1,
        ),
        RolloutClient(stack.gateway_url, timeout=120) as client,
    ):  # fmt: skip
        sampling = {**SAMPLING, "max_tokens": 64}  # room for the whole scripted call
        job_id = client.submit_rollout(SHELL_TASK, sampling=sampling, agent={"max_turns": 8})
        assert isinstance(job_id, str)
        wait_until(
            lambda: len(model_turns(client.get_rollout(job_id))) >= 1, 120, "a first model turn"
        )
        drained = client.drain_backend(None, wait=120)
        assert isinstance(drained, list) and all(b.idle for b in drained), drained
        # Drained: the job waits between turns and the engine gets nothing new.
        time.sleep(1.0)  # the last turn's partial trajectory is saved just after its request
        before = engine_metrics(vllm_server.url).get("vllm:generation_tokens_total", 0.0)
        waited = len(model_turns(client.get_rollout(job_id)))
        time.sleep(3.0)
        assert client.get_rollout(job_id).status is JobStatus.run
        assert len(model_turns(client.get_rollout(job_id))) == waited
        assert engine_metrics(vllm_server.url).get("vllm:generation_tokens_total", 0.0) == before
        client.resume_backend(None, policy_version=2)
        wait_until(lambda: client.get_rollout(job_id).status.terminal, 180, "the job to end")
        traj = client.get_rollout(job_id)
    assert traj.status is JobStatus.completed, traj.error
    versions = [t.policy_version for t in model_turns(traj)]
    assert versions == sorted(versions) and set(versions) == {1, 2}, versions
    assert versions == [1, 2] and waited == 1
    assert traj.stop_reason == "finish" and traj.reward == 1.0
    assert {t.backend_id for t in model_turns(traj)} == {"update"}


@pytest.fixture(scope="module")
def second_server(
    vllm_server: VllmServer, devserver_factory: Callable[..., DevBackend]
) -> Iterator[tuple[str, int]]:
    """A second server of the same model beside the real vLLM: the development server
    sampling from the tiny model (vLLM's API, its own process group), so the session starts
    one vLLM only. Yields its URL and process group; the test kills it."""
    backend = devserver_factory(
        "fleet-second", args=["--served-model-name", vllm_server.model, "--max-model-len", "2048"]
    )
    yield backend.url, backend.proc.pid


def stranded_mid_episode(group: int, mid_episode: Callable[[], set[str]]) -> set[str]:
    """Freeze the server's process group (SIGSTOP) at a moment `mid_episode()` names jobs, and
    return the jobs it still names once the reading has settled: with the server frozen, an
    episode that did not need it again ends and drops out, and those left wait on a request to
    it. The server stays frozen for the caller to kill; with no such job it thaws and waits on."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        wait_until(lambda: bool(mid_episode()), 300, "a job with a turn done on the server")
        os.killpg(group, signal.SIGSTOP)
        reading, settled = mid_episode(), 0
        while reading and settled < 3:  # the same jobs over three readings 0.5 s apart
            time.sleep(0.5)
            again = mid_episode()
            settled = settled + 1 if again == reading else 0
            reading = again
        if reading:
            return reading
        os.killpg(group, signal.SIGCONT)
    raise AssertionError("no job was ever left waiting on the server mid-episode")


def test_a_server_killed_mid_batch_loses_no_job(
    stack: Stack, vllm_server: VllmServer, second_server: tuple[str, int]
) -> None:
    url, group = second_server
    extra = stack.start_worker("run", 3)
    stack.wait_worker(extra)
    try:
        with (
            registered(stack, vllm_server.url, vllm_server.model, api="completions",
                       backend_id="keeps"),
            registered(stack, url, vllm_server.model, api="completions", backend_id="dies"),
            RolloutClient(stack.gateway_url, timeout=120) as client,
        ):  # fmt: skip
            accepted = client.submit_batch(
                [math_task(n) for n in range(2, 8)], sampling=SAMPLING, agent={"max_turns": 3}
            )

            pool = BackendPool(redis.Redis.from_url(stack.redis_url))

            def on_dies() -> set[str]:
                return {job for job, held in pool.holders().items() if held == "dies"}

            def mid_episode_on_dies() -> set[str]:
                """Jobs in RUN that hold the second server and have a turn done on it."""
                jobs = set()
                for job in on_dies():
                    partial = client.get_rollout(job)
                    if partial.status is JobStatus.run and "dies" in {
                        m.backend_id for m in model_turns(partial)
                    }:
                        jobs.add(job)
                return jobs

            stranded = stranded_mid_episode(group, mid_episode_on_dies)
            os.killpg(group, signal.SIGKILL)
            wait_until(
                lambda: client.batch_progress(accepted.batch_id).done, 600, "the batch to end"
            )
            results = list(client.iter_batch_results(accepted.batch_id))
            dies = next(b for b in client.list_backends() if b.id == "dies")
        assert sorted(t.job_id for t in results) == sorted(accepted.jobs)
        assert {t.status for t in results} == {JobStatus.completed}, [t.error for t in results]
        assert dies.state == "dead"
        # The jobs that held the killed server when it died ended their episodes on the other.
        ends = {t.job_id: [m.backend_id for m in model_turns(t)] for t in results}
        assert stranded and all(ends[job][-1] == "keeps" for job in stranded), (stranded, ends)
        assert any("dies" in ends[job] for job in stranded), ends  # moved mid-episode
        print(f"\n{len(stranded)} job(s) on the killed server; turns by backend: {ends}")
    finally:
        stack.kill_worker(extra, signal.SIGKILL)
