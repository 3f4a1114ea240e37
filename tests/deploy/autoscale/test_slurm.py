"""The Slurm launcher and the batch recipes of deploy/slurm against a real one-node Slurm
cluster (munged, slurmctld, slurmd on localhost; `tests/support/slurm.py`)."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from api.client import RolloutClient
from broker.jobstore import JobStore
from broker.processes import free_port
from core.schemas import JobStatus
from deploy.autoscale.slurm import SlurmLauncher
from deploy.autoscale.state import read_loads
from deploy.stack import Stack
from tests.support.slurm import SlurmCluster, find_program
from tests.support.wait import wait_until

pytestmark = pytest.mark.slurm

ACTIVE = (JobStatus.queued, JobStatus.init, JobStatus.run, JobStatus.eval)
RECIPES = Path(__file__).resolve().parents[3] / "deploy" / "slurm"


def squeue_ids(cluster: SlurmCluster) -> list[str]:
    return cluster.run("squeue", "--noheader", "--format=%i").stdout.split()


def test_a_worker_job_consumes_a_job_and_a_warm_stop_lets_the_next_finish(
    slurm_cluster: SlurmCluster,
    runless_stack: Stack,
    store: JobStore,
    tmp_path: Path,
    fast_task: dict[str, str],
    slow_task: dict[str, str],
) -> None:
    env = {**runless_stack.child_env(), **{k: v for k, v in slurm_cluster.env().items()
                                           if k in ("SLURM_CONF", "PATH")}}  # fmt: skip
    launcher = SlurmLauncher(env=env, log_dir=tmp_path / "jobs")
    (worker,) = launcher.start("run", 1)
    try:
        assert [w.id for w in launcher.workers("run")] == [worker.id]
        assert dict(launcher.jobs("run"))[worker.id] in ("PENDING", "CONFIGURING", "RUNNING")
        with RolloutClient(runless_stack.gateway_url) as client:
            fast = str(client.submit_rollout(fast_task))
            wait_until(
                lambda: client.get_rollout(fast).status is JobStatus.completed,
                120,
                f"the Slurm worker job to consume the job (logs in {tmp_path / 'jobs'})",
            )
            slow = str(client.submit_rollout(slow_task))
            wait_until(lambda: read_loads(store)["run"].in_flight == 1, 60, "the job in RUN")
            launcher.stop("run", [worker])
            assert launcher.workers("run") == []  # stopping: no longer counted
            wait_until(lambda: worker.id not in squeue_ids(slurm_cluster), 60, "the job to end")
            # Its RUN is done; EVAL (another worker) may still be grading.
            wait_until(
                lambda: client.get_rollout(slow).status not in ACTIVE, 60, "the rollout to end"
            )
            trajectory = client.get_rollout(slow)
            assert trajectory.status is JobStatus.completed, trajectory.error
        log = next((tmp_path / "jobs").glob(f"*-{worker.id}.out")).read_text()
        assert "warm shutdown" in log.lower(), log[-2000:]
    finally:
        slurm_cluster.run("scancel", worker.id, check=False)


def test_the_stack_and_worker_array_recipes_serve_and_register(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    env = {
        **slurm_cluster.env(),
        "ROLLSERVE_SHARED_DIR": str(shared),
        "ROLLSERVE_STACK_HOST": "127.0.0.1",
        "ROLLSERVE_REDIS_PORT": str(free_port()),
        "ROLLSERVE_PORT": str(free_port()),
        "ROLLSERVE_PYTHON": sys.executable,
        "ROLLSERVE_COMMAND": shlex.join([sys.executable, "-m", "deploy.cli"]),
        "ROLLSERVE_STACK_WAIT": "120",
    }
    env.pop("ROLLSERVE_REDIS_URL", None)
    out = f"--output={tmp_path / '%x-%A_%a.out'}"

    def submit(*args: str) -> str:
        done = subprocess.run(
            [str(find_program("sbatch")), "--parsable", "--export=ALL", out, *args],
            env=env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    stack = submit(str(RECIPES / "stack.sbatch"))
    workers = submit(f"--dependency=after:{stack}", "--array=0-1", str(RECIPES / "workers.sbatch"))
    try:
        wait_until(lambda: (shared / "gateway_url").exists(), 60, f"the stack job ({tmp_path})")
        gateway = (shared / "gateway_url").read_text().strip()

        def healthy() -> bool:
            try:
                return httpx.get(f"{gateway}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 90, f"{gateway}/healthz to answer (job logs in {tmp_path})")
        assert httpx.get(f"{gateway}/healthz", timeout=5).json()["redis"] is True
        assert (shared / "redis_url").stat().st_mode & 0o077 == 0
        client = redis.Redis.from_url((shared / "redis_url").read_text().strip())
        store = JobStore(client)
        nodes = [f"{slurm_cluster.node}-{task}" for task in (0, 1)]
        wanted = [(node, stage) for node in nodes for stage in ("init", "run", "eval")]
        wait_until(
            lambda: all(store.node_alive(node, stage) for node, stage in wanted),
            120,
            f"each array task's three workers to beat (job logs in {tmp_path})",
        )
        assert set(nodes) <= set(store.nodes())
        client.close()
    finally:
        # The workers first, while their broker (the stack's Redis) is up: a worker whose
        # broker went away first keeps trying to reach it for minutes before it exits.
        slurm_cluster.run("scancel", "--batch", "--signal=TERM", workers, check=False)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: not any(i.split("_")[0] == workers for i in squeue_ids(slurm_cluster)),
                60,
                "the worker array to stop",
            )
        slurm_cluster.run("scancel", workers, check=False)  # what is left: TERM, then KILL
        slurm_cluster.run("scancel", stack, check=False)
    wait_until(lambda: squeue_ids(slurm_cluster) == [], 90, "the recipe jobs to end")
