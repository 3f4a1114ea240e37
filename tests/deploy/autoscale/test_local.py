"""The local launcher against a real stack: worker processes that consume real jobs, started
on a backlog by the autoscaler and stopped warm while a job runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api.client import RolloutClient
from broker.jobstore import JobStore
from core.schemas import JobStatus
from deploy.autoscale.autoscaler import Autoscaler
from deploy.autoscale.local import LocalLauncher
from deploy.autoscale.policy import default_policy
from deploy.autoscale.state import read_loads
from deploy.stack import Stack
from tests.support.wait import wait_until

ACTIVE = (JobStatus.queued, JobStatus.init, JobStatus.run, JobStatus.eval)


def status(client: RolloutClient, job_id: str) -> JobStatus:
    return client.get_rollout(job_id).status


def test_a_backlog_starts_workers_that_consume_it(
    runless_stack: Stack,
    store: JobStore,
    tmp_path: Path,
    fast_task: dict[str, str],
) -> None:
    launcher = LocalLauncher(runless_stack.child_env(), tmp_path / "logs", stop_timeout=60)
    policy = default_policy("run", min_workers=0, max_workers=2, scale_to_zero=True,
                            scale_out_cooldown=0.0, scale_in_cooldown=0.0)  # fmt: skip
    scaler = Autoscaler(launcher, {"run": policy}, lambda: read_loads(store))
    try:
        (idle,) = scaler.tick()
        assert idle.decision.desired == 0 and launcher.workers("run") == []
        with RolloutClient(runless_stack.gateway_url) as client:
            jobs = [str(client.submit_rollout(fast_task)) for _ in range(3)]
            wait_until(lambda: read_loads(store)["run"].waiting == 3, 60, "3 jobs waiting on run")
            (step,) = scaler.tick()
            assert step.decision.load.waiting == 3 and step.decision.desired == 2
            assert len(launcher.workers("run")) == 2
            wait_until(
                lambda: all(status(client, j) is JobStatus.completed for j in jobs),
                90,
                "the backlog to be consumed by the started workers",
            )
        pids = [int(w.id) for w in launcher.workers("run")]
        assert all(os.getpgid(pid) == pid for pid in pids)  # each leads its own group
        # Idle again: the autoscaler stops both (warm), and they exit.
        (step,) = scaler.tick()
        assert step.decision.load.demand == 0 and step.decision.desired == 0
        assert launcher.workers("run") == []
        wait_until(lambda: launcher.stopping == 0, 60, "the stopped workers to exit")
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
    finally:
        launcher.close()
    assert launcher.workers("run") == [] and launcher.stopping == 0


def test_a_warm_stop_lets_the_running_job_finish(
    runless_stack: Stack,
    store: JobStore,
    tmp_path: Path,
    slow_task: dict[str, str],
) -> None:
    launcher = LocalLauncher(runless_stack.child_env(), tmp_path / "logs", stop_timeout=60)
    try:
        (worker,) = launcher.start("run", 1)
        with RolloutClient(runless_stack.gateway_url) as client:
            job = str(client.submit_rollout(slow_task))
            wait_until(lambda: read_loads(store)["run"].in_flight == 1, 60, "the job in RUN")
            assert launcher.scale("run", 0) == 1
            assert launcher.workers("run") == [] and launcher.stopping == 1
            wait_until(lambda: launcher.stopping == 0, 60, "the stopped worker to exit")
            # Its RUN is done; EVAL (another worker) may still be grading.
            wait_until(lambda: status(client, job) not in ACTIVE, 60, "the job to end")
            trajectory = client.get_rollout(job)
            assert trajectory.status is JobStatus.completed, trajectory.error
            assert trajectory.reward == 1.0
        with pytest.raises(ProcessLookupError):  # its process group is gone with it
            os.killpg(int(worker.id), 0)
    finally:
        launcher.close()


def test_run_workers_with_jobs_hold_many_each_and_stop_warm(
    runless_stack: Stack,
    store: JobStore,
    tmp_path: Path,
    slow_task: dict[str, str],
) -> None:
    """`--run-jobs 4`: one RUN process takes a backlog of four slow jobs at once (the policy
    counts its four slots), and its warm stop lets all four finish."""
    launcher = LocalLauncher(
        runless_stack.child_env(), tmp_path / "logs", stop_timeout=60, run_jobs=4
    )
    policy = default_policy("run", concurrency=4, min_workers=0, max_workers=3,
                            scale_to_zero=True, scale_out_cooldown=0.0,
                            scale_in_cooldown=0.0)  # fmt: skip
    scaler = Autoscaler(launcher, {"run": policy}, lambda: read_loads(store))
    try:
        with RolloutClient(runless_stack.gateway_url) as client:
            jobs = [str(client.submit_rollout(slow_task)) for _ in range(4)]
            wait_until(lambda: read_loads(store)["run"].waiting == 4, 60, "4 jobs waiting on run")
            (step,) = scaler.tick()
            assert step.decision.desired == 2  # 4 jobs fill 80 % of two workers' 4 slots
            launcher.scale("run", 1)
            (worker,) = launcher.workers("run")
            argv = Path(f"/proc/{worker.id}/cmdline").read_bytes().split(b"\0")
            assert b"--jobs" in argv and b"--concurrency" not in argv
            wait_until(lambda: read_loads(store)["run"].in_flight == 4, 60, "all 4 in RUN at once")
            launcher.scale("run", 0)
            wait_until(lambda: launcher.stopping == 0, 60, "the stopped worker to exit")
            wait_until(lambda: all(status(client, j) not in ACTIVE for j in jobs), 60, "the ends")
            finished = [client.get_rollout(j) for j in jobs]
            assert [t.status for t in finished] == [JobStatus.completed] * 4, [
                t.error for t in finished
            ]
    finally:
        launcher.close()
