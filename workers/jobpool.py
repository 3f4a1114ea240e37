"""The pool of a many-jobs RUN worker: Celery's threads pool, whose `terminate` cancels.

`rollserve worker run --jobs N` starts Celery with this pool (`-P custom`, named by
`CELERY_CUSTOM_WORKER_POOL`) and `-c N`. Each
thread takes one stage task; the RUN stage's episode runs on the process's shared event loop
(`workers.jobsloop`). Celery terminates a revoked task by killing its process, which a
thread pool cannot do (its threads pool answers `NotImplementedError` and the task runs on);
here terminating a task cancels its job's episode on the loop instead, and the stage unwinds
and frees what it holds as a cancelled stage does.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.concurrency.thread import ApplyResult
from celery.concurrency.thread import TaskPool as ThreadTaskPool

from broker.jobstore import job_of_task
from workers.jobsloop import ENDED
from workers.process_state import get_runtime

log = logging.getLogger(__name__)

POOL_ENV = "CELERY_CUSTOM_WORKER_POOL"
"""Celery takes a pool class of its own from this variable, as its pool `custom`."""
POOL_CLASS = "workers.jobpool:JobsPool"


def raise_open_files_limit() -> int:
    """Lift this process's soft limit of open files to its hard limit (a thousand jobs hold a
    connection each to their backend, and some a socket to their sandbox); the new limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            log.warning("could not raise the open files limit from %d", soft)
    return soft


def use_jobs_pool() -> list[str]:
    """Make `-P custom` mean this pool in this process (also when Celery was imported
    already) and in its children; the worker arguments that select it."""
    import os

    from celery import concurrency

    os.environ[POOL_ENV] = POOL_CLASS
    concurrency.ALIASES["custom"] = POOL_CLASS
    return ["-P", "custom"]


class CancellableResult(ApplyResult):
    """A task running on a pool thread; `terminate` cancels its job's episode."""

    def __init__(self, result: ApplyResult, task_id: str | None) -> None:
        super().__init__(result.f)
        self.task_id = task_id

    def terminate(self, signal: int | None = None) -> None:
        job_id = job_of_task(self.task_id) if self.task_id else None
        if job_id is None:
            return
        try:
            get_runtime().jobs.cancel(job_id, ENDED)
        except Exception:
            log.exception("cancelling job %s's episode failed", job_id)


class JobsPool(ThreadTaskPool):
    """Celery's threads pool, with termination by cancellation (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Celery's request keeps only a weak reference to what `on_apply` returns: the pool
        # holds each until its task is done, so a revoke can still reach it.
        self._running: set[CancellableResult] = set()

    def on_start(self) -> None:
        super().on_start()
        raise_open_files_limit()
        get_runtime().jobs  # noqa: B018 - the loop and its watch start with the pool

    def on_apply(
        self,
        target: Any,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Any = None,
        accept_callback: Any = None,
        **options: Any,
    ) -> ApplyResult:
        result = super().on_apply(target, args, kwargs, callback, accept_callback, **options)
        # Celery's tracer is called with (task name, task id, request, body, ...).
        task_id = args[1] if args and len(args) > 1 and isinstance(args[1], str) else None
        held = CancellableResult(result, task_id)
        self._running.add(held)
        result.f.add_done_callback(lambda _f: self._running.discard(held))
        return held

    def terminate_job(self, pid: int, signal: int | None = None) -> None:
        """Nothing to kill: the task's `terminate` (Celery calls it next) cancels its job."""
