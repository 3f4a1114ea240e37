"""Where workers run: the interface every launcher keeps.

A launcher starts workers on one queue, lists the ones that count toward its fleet, and stops
some by warm shutdown: Celery's worker takes SIGTERM (to its main process only) as "take no new
job, finish the running ones, then exit", so a stopped worker never cuts a job short. A worker
being stopped no longer counts toward the fleet, though it may run for a while yet.
"""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class LauncherError(RuntimeError):
    """A launcher could not start, list or stop workers (its tool failed or is missing)."""


def run_command(argv: list[str], env: dict[str, str], name: str) -> str:
    """The standard output of a launcher's command (`kubectl`, `sbatch`, ...), at most 60 s;
    `LauncherError` naming `name` when it cannot run or exits non-zero."""
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherError(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise LauncherError(f"{name} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def worker_args(queue: str, concurrency: int, run_jobs: int = 0) -> list[str]:
    """The slots of a worker the autoscaler starts on `queue`, as `rollserve worker` flags:
    `run_jobs` jobs on one event loop for RUN when set (`--jobs`), else `concurrency` prefork
    processes."""
    if queue == "run" and run_jobs > 0:
        return ["--jobs", str(run_jobs)]
    return ["--concurrency", str(concurrency)]


def slots(queue: str, concurrency: int, run_jobs: int = 0) -> int:
    """How many jobs at once a worker started with `worker_args` holds."""
    return run_jobs if queue == "run" and run_jobs > 0 else concurrency


@dataclass(frozen=True)
class Worker:
    """One worker a launcher started."""

    id: str
    """The launcher's name for it: a process group id, a Slurm job id, a pod ordinal."""
    queue: str
    started: float
    """When it was asked for (Unix time; 0 when the launcher cannot tell)."""


class Launcher(ABC):
    """Starts, lists and warm-stops the workers of each queue."""

    name: str = "launcher"

    @abstractmethod
    def start(self, queue: str, count: int) -> list[Worker]:
        """Start `count` more workers on `queue`."""

    @abstractmethod
    def workers(self, queue: str) -> list[Worker]:
        """The workers of `queue` that run or are about to, oldest first; not those being
        stopped."""

    @abstractmethod
    def stop(self, queue: str, workers: Sequence[Worker]) -> None:
        """Warm-stop `workers`: each finishes the jobs it runs, then exits."""

    def scale(self, queue: str, desired: int) -> int:
        """Start or stop workers until `queue` has `desired`; returns how many it had. The
        newest are stopped first: the oldest have warm connections and caches."""
        current = self.workers(queue)
        if desired > len(current):
            self.start(queue, desired - len(current))
        elif desired < len(current):
            self.stop(queue, current[desired:][::-1])
        return len(current)

    def close(self) -> None:
        """Let go of what the launcher holds; by default its workers go on running."""
        return None
