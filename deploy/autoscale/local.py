"""Workers as processes on this machine, each `rollserve worker QUEUE` in its own process group.

A warm stop sends SIGTERM to the worker's main process alone (its pool processes would die
with a job in hand); once the main process has exited, whatever is left of its group is
killed. Closing the launcher warm-stops every worker and waits for them, up to a timeout.

Workers are tied to the life of the thread that started them (a parent-death signal, which
the kernel sends when that thread ends): start them from a thread that outlives them, as the
autoscaler's loop does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from broker.processes import spawn, stop_group
from deploy.autoscale.launcher import Launcher, Worker, worker_args


class LocalLauncher(Launcher):
    """`rollserve worker` processes on this host, started with `env` (which must hold
    `ROLLSERVE_REDIS_URL`), logging to `log_dir/<queue>-<pid>.log`."""

    name = "local"

    def __init__(
        self,
        env: dict[str, str],
        log_dir: Path,
        concurrency: int = 1,
        stop_timeout: float = 300.0,
        run_jobs: int = 0,
    ) -> None:
        self.env = env
        self.log_dir = log_dir
        self.concurrency = concurrency
        self.run_jobs = run_jobs
        """With N > 0, RUN workers hold N jobs each on one event loop (`--jobs N`)."""
        self.stop_timeout = stop_timeout
        self._running: dict[str, list[tuple[Worker, subprocess.Popen[bytes]]]] = {}
        self._stopping: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def start(self, queue: str, count: int) -> list[Worker]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        node = self.env.get("ROLLSERVE_NODE_NAME") or os.uname().nodename
        started = []
        for _ in range(count):
            hostname = f"{queue}-auto-{uuid.uuid4().hex[:8]}@{node}"
            argv = [
                sys.executable, "-m", "deploy.cli", "worker", queue,
                *worker_args(queue, self.concurrency, self.run_jobs), "--hostname", hostname,
            ]  # fmt: skip
            log_path = self.log_dir / f"{hostname.split('@')[0]}.log"
            proc = spawn(argv, env=self.env, log_path=str(log_path))
            worker = Worker(id=str(proc.pid), queue=queue, started=time.time())
            with self._lock:
                self._running.setdefault(queue, []).append((worker, proc))
            started.append(worker)
        return started

    def workers(self, queue: str) -> list[Worker]:
        self._reap()
        with self._lock:
            return [worker for worker, _ in self._running.get(queue, [])]

    def stop(self, queue: str, workers: Sequence[Worker]) -> None:
        ids = {w.id for w in workers}
        with self._lock:
            keep: list[tuple[Worker, subprocess.Popen[bytes]]] = []
            leaving: list[tuple[Worker, subprocess.Popen[bytes]]] = []
            for worker, proc in self._running.get(queue, []):
                (leaving if worker.id in ids else keep).append((worker, proc))
            self._running[queue] = keep
            for _, proc in leaving:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)  # the main process: warm shutdown
                self._stopping.append(proc)

    @property
    def stopping(self) -> int:
        """Workers told to stop that have not exited yet."""
        self._reap()
        with self._lock:
            return len(self._stopping)

    def _reap(self) -> None:
        """Forget workers that exited (and kill what is left of their groups)."""
        with self._lock:
            for queue, pairs in self._running.items():
                alive = []
                for worker, proc in pairs:
                    if proc.poll() is None:
                        alive.append((worker, proc))
                    else:
                        stop_group(proc)
                self._running[queue] = alive
            still = []
            for proc in self._stopping:
                if proc.poll() is None:
                    still.append(proc)
                else:
                    stop_group(proc)
            self._stopping = still

    def close(self) -> None:
        """Warm-stop every worker and wait for all to exit; after `stop_timeout` seconds
        those left are killed with their process groups."""
        for queue in list(self._running):
            self.stop(queue, self.workers(queue))
        deadline = time.monotonic() + self.stop_timeout
        with self._lock:
            leaving = list(self._stopping)
            self._stopping = []
        for proc in leaving:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            stop_group(proc, timeout=5)
