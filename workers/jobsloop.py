"""Many RUN jobs in one worker process: their episodes share one asyncio event loop.

`rollserve worker run --jobs N` runs Celery's threads pool (`workers.jobpool`) with N threads.
A thread takes a RUN stage as usual — the job store's marks, late acknowledgement and
exactly-once completion are the same as on prefork — but the episode itself, which spends
nearly all its life waiting on the inference fleet or on a tool, runs as a task on the
process's one event loop (`JobsLoop`), on its own thread; the stage's thread waits for it.
An in-flight job then costs a coroutine, its trajectory and a parked thread, not a process.

Without prefork's process kill, time limits and cancellation cancel the job's task:
- a job whose record ended (cancelled, its batch's target met) is stopped as soon as the job
  store announces its end (`ended_feed`: Redis pub/sub, pushed, no polling), and, should
  that announcement be lost, by one batched read of all in-flight jobs' statuses every
  `poll` seconds (`watch`), and by the pool's `terminate` when Celery revokes the stage; its
  task is cancelled, its in-flight request aborted, and the stage ends as a cancelled one
  does (`JobCancelled`);
- a stage past its soft time limit has its task cancelled and ends as timed out
  (`SoftTimeLimitExceeded`, as Celery raises it on prefork);
- a task that is still running `grace` seconds after it was cancelled ignores cancellation:
  the stage gives up waiting (the job is ended all the same), and the job is reported —
  logged, counted in `ignored` and by `on_ignored` (the job store's counter, exported as
  `rollserve_ignored_cancellations` on `/metrics`), and listed by `stuck()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from celery.exceptions import SoftTimeLimitExceeded

from workers.routed_policy import JobCancelled

log = logging.getLogger(__name__)
T = TypeVar("T")

ENDED = "ended"
TIME_LIMIT = "time_limit"


class JobsLoop:
    """One event loop thread running the episodes of many jobs, and a thread watching them.

    `live_of` answers which of some job ids are still live (one round trip for all of them);
    it is asked every `poll` seconds about the jobs in flight. `ended_feed(on_ended, stop)`,
    when given, blocks calling `on_ended(job_id)` for every job that ends anywhere until
    `stop` is set (the job store's `listen_ended`); it runs on a thread of its own.
    """

    def __init__(
        self,
        live_of: Callable[[Iterable[str]], set[str]],
        *,
        poll: float = 0.5,
        grace: float = 10.0,
        on_ignored: Callable[[str], None] = lambda _job_id: None,
        ended_feed: Callable[[Callable[[str], None], threading.Event], None] | None = None,
    ) -> None:
        self.live_of = live_of
        self.on_ignored = on_ignored
        self.poll = poll
        self.grace = grace
        self.loop = asyncio.new_event_loop()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._reasons: dict[str, str] = {}
        self._ended: set[str] = set()
        self._stuck: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ignored = 0
        """Jobs whose task went on running `grace` seconds after it was cancelled."""
        self._thread = threading.Thread(target=self._serve, name="jobs-loop", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="jobs-watch", daemon=True)
        self._feed: threading.Thread | None = None
        if ended_feed is not None:
            self._feed = threading.Thread(
                target=ended_feed, args=(self._on_ended, self._stop), name="jobs-ended", daemon=True
            )
        self._thread.start()
        self._watcher.start()
        if self._feed is not None:
            self._feed.start()

    # ------------------------------------------------------------------ running jobs

    def run(self, coro: Coroutine[Any, Any, T], job_id: str, time_limit: float | None = None) -> T:
        """Run `coro` as job `job_id`'s task on the loop and wait for it (from any other
        thread). Raises `JobCancelled` when the job ended meanwhile and
        `SoftTimeLimitExceeded` after `time_limit` seconds."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("JobsLoop.run was called from the loop's own thread")
        with self._lock:
            self._ended.discard(job_id)
            self._reasons.pop(job_id, None)
        future = asyncio.run_coroutine_threadsafe(self._as_job(coro, job_id), self.loop)
        try:
            return future.result(timeout=time_limit)
        except concurrent.futures.TimeoutError:
            self.cancel(job_id, TIME_LIMIT)
            self._await_cancelled(future, job_id)
            raise SoftTimeLimitExceeded(f"run passed its {time_limit:g}s limit") from None
        except concurrent.futures.CancelledError:
            reason = self._reasons.get(job_id)
            if reason == TIME_LIMIT:
                raise SoftTimeLimitExceeded("run passed its time limit") from None
            raise JobCancelled(f"job {job_id} is no longer live") from None
        finally:
            with self._lock:
                self._reasons.pop(job_id, None)
                self._ended.discard(job_id)  # asked only while the job runs here

    async def _as_job(self, coro: Coroutine[Any, Any, T], job_id: str) -> T:
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            self._tasks[job_id] = task
        try:
            return await coro
        finally:
            with self._lock:
                if self._tasks.get(job_id) is task:
                    del self._tasks[job_id]
                self._stuck.pop(job_id, None)

    def cancel(self, job_id: str, reason: str = ENDED) -> bool:
        """Cancel the job's task (from any thread); whether it had one in flight."""
        with self._lock:
            task = self._tasks.get(job_id)
            if task is None:
                return False
            self._reasons.setdefault(job_id, reason)
            if reason == ENDED:
                self._ended.add(job_id)
        self.loop.call_soon_threadsafe(task.cancel)
        return True

    def _await_cancelled(self, future: concurrent.futures.Future[Any], job_id: str) -> None:
        try:
            future.result(timeout=self.grace)
        except concurrent.futures.TimeoutError:
            self.ignored += 1
            with self._lock:
                self._stuck[job_id] = time.time()
            log.error(
                "job %s ignored its cancellation for %.0fs: its task still runs on the jobs "
                "loop (the job is ended all the same)",
                job_id,
                self.grace,
            )
            try:
                self.on_ignored(job_id)
            except Exception:
                log.exception("reporting job %s's ignored cancellation failed", job_id)
        except (concurrent.futures.CancelledError, Exception):
            return  # the task ended, however: that is all the cancel waited for

    # ------------------------------------------------------------------ what is known

    def is_live(self, job_id: str) -> bool:
        """False once the watch (or a revoke) found the job ended; no Redis read."""
        return job_id not in self._ended

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def stuck(self) -> dict[str, float]:
        """Jobs whose task ignored cancellation, with when it was reported."""
        with self._lock:
            return dict(self._stuck)

    # ------------------------------------------------------------------ threads

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                ids = [job_id for job_id in self._tasks if job_id not in self._ended]
            if not ids:
                continue
            try:
                live = self.live_of(ids)
            except Exception:
                log.exception("reading the status of %d jobs in flight failed", len(ids))
                continue
            for job_id in ids:
                if job_id not in live:
                    self.cancel(job_id, ENDED)

    def _on_ended(self, job_id: str) -> None:
        """A job ended somewhere: stop its task if it runs here."""
        with self._lock:
            here = job_id in self._tasks and job_id not in self._ended
        if here:
            self.cancel(job_id, ENDED)

    def close(self) -> None:
        """Stop the watch and the loop (tasks still on it are cancelled)."""
        self._stop.set()

        def shut() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        if self.loop.is_running():
            self.loop.call_soon_threadsafe(shut)
        self._thread.join(timeout=5)
        self._watcher.join(timeout=5)
        if self._feed is not None:
            self._feed.join(timeout=5)
