"""Workers as Slurm jobs: one batch job per worker, running `deploy/slurm/worker.sbatch`.

`sbatch --parsable` submits each (named `<prefix>-<queue>`, with this process's environment,
so the job inherits `ROLLSERVE_REDIS_URL` and the rest), `squeue --me` lists this user's
pending and running ones, and a warm stop is `scancel --batch --signal=TERM`: the signal goes
to the batch step's shell alone, which the script replaced with the worker (`exec`), so the
worker's main process begins a warm shutdown and its pool processes, which would die of
SIGTERM with a job in hand, are not signalled (`--full` would signal them too). A job still
pending is simply cancelled. The job ends when the worker has finished its jobs and exited.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.autoscale.launcher import Launcher, Worker, run_command, slots

WORKER_SCRIPT = Path(__file__).resolve().parent.parent / "slurm" / "worker.sbatch"
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "RESIZING", "REQUEUED")


class SlurmLauncher(Launcher):
    """Submits, lists and warm-stops worker jobs with Slurm's commands.

    `sbatch_args` go to every submission (partition, account, `--time`, `--cpus-per-task`);
    `env` is the environment the commands run with and the jobs inherit (`SLURM_CONF` to
    reach another cluster; `ROLLSERVE_REDIS_URL` for the workers); `command` is the
    `rollserve` the jobs run (nodes that share this file system can run this interpreter)."""

    name = "slurm"

    def __init__(
        self,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        concurrency: int = 1,
        sbatch_args: Sequence[str] = (),
        job_prefix: str = "rollserve",
        script: Path = WORKER_SCRIPT,
        command: Sequence[str] = (sys.executable, "-m", "deploy.cli"),
        run_jobs: int = 0,
    ) -> None:
        self.env = dict(os.environ if env is None else env)
        # What the batch script runs as `rollserve`: this interpreter's, unless told otherwise.
        self.env.setdefault("ROLLSERVE_COMMAND", shlex.join(command))
        self.log_dir = log_dir
        self.concurrency = concurrency
        self.run_jobs = run_jobs
        """With N > 0, RUN workers hold N jobs each on one event loop (`--jobs N`)."""
        self.sbatch_args = list(sbatch_args)
        self.job_prefix = job_prefix
        self.script = script
        self._stopping: set[str] = set()

    def job_name(self, queue: str) -> str:
        return f"{self.job_prefix}-{queue}"

    def _run(self, argv: list[str]) -> str:
        return run_command(argv, self.env, f"{' '.join(argv[:2])} ...")

    def start(self, queue: str, count: int) -> list[Worker]:
        argv = ["sbatch", "--parsable", f"--job-name={self.job_name(queue)}", "--export=ALL"]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            argv.append(f"--output={self.log_dir / '%x-%j.out'}")
        mode = ["jobs"] if queue == "run" and self.run_jobs > 0 else []
        per_worker = slots(queue, self.concurrency, self.run_jobs)
        argv += [*self.sbatch_args, str(self.script), queue, str(per_worker), *mode]
        started = []
        for _ in range(count):
            job_id = self._run(argv).strip().split(";")[0]
            started.append(Worker(id=job_id, queue=queue, started=time.time()))
        return started

    def jobs(self, queue: str) -> list[tuple[str, str]]:
        """(job id, state) of this queue's active worker jobs, oldest first."""
        out = self._run(
            ["squeue", "--noheader", "--me", f"--name={self.job_name(queue)}", "--format=%i|%T",
             f"--states={','.join(ACTIVE_STATES)}"]
        )  # fmt: skip
        found = []
        for line in out.splitlines():
            job_id, _, state = line.strip().partition("|")
            if job_id:
                found.append((job_id, state))
        return sorted(found, key=lambda j: int(j[0]) if j[0].isdigit() else 0)

    def workers(self, queue: str) -> list[Worker]:
        active = self.jobs(queue)
        self._stopping &= {job_id for job_id, _ in active}
        return [
            Worker(id=job_id, queue=queue, started=0.0)
            for job_id, _ in active
            if job_id not in self._stopping
        ]

    def stop(self, queue: str, workers: Sequence[Worker]) -> None:
        states = dict(self.jobs(queue))
        for worker in workers:
            if states.get(worker.id) == "PENDING":
                self._run(["scancel", worker.id])
            else:
                self._run(["scancel", "--batch", "--signal=TERM", worker.id])
            self._stopping.add(worker.id)
