"""What a worker process holds across tasks: Redis, the job store, the backend pool, an event loop
and one inference client per backend (so connections and template pieces are reused)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from celery import Celery

from broker.celery_app import get_celery
from broker.connections import redis_client
from broker.jobstore import JobNotFound, JobStore
from core.schemas import Backend, JobStatus, StageError, Trajectory
from core.settings import Settings, get_settings
from routing.chat import ChatTemplater
from routing.clients import make_client
from routing.pool import BackendPool
from routing.protocol import InferenceClient
from workers.dispatch import Dispatcher
from workers.holdings import free
from workers.jobsloop import JobsLoop

T = TypeVar("T")


@dataclass
class Runtime:
    """Per-process state of a worker; stage functions take it as their first argument."""

    settings: Settings
    store: JobStore
    pool: BackendPool
    celery: Celery | None = None
    """The Celery app ends are followed up through (the process's own, `get_celery()`, when
    None)."""
    _dispatcher: Dispatcher | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _clients: dict[str, tuple[str, InferenceClient, ChatTemplater]] = field(default_factory=dict)
    _jobs: JobsLoop | None = None
    _jobs_lock: threading.Lock = field(default_factory=threading.Lock)

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        job_id: str | None = None,
        time_limit: float | None = None,
    ) -> T:
        """Run `coro` on this process's event loop; one broken by an interrupt is replaced.

        Called for a job from a pool thread (`rollserve worker run --jobs N`), `coro` runs as
        that job's task on the process's shared jobs loop instead (`workers.jobsloop`), which
        enforces `time_limit` and cancels it when the job ends."""
        if job_id is not None and shares_loop():
            return self.jobs.run(coro, job_id, time_limit)
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(coro)
        except BaseException:
            # A time limit raised mid-await leaves tasks and sockets pending: start afresh.
            self._discard_loop()
            raise

    @property
    def jobs(self) -> JobsLoop:
        """The shared event loop of the jobs this process runs at once (made on first use)."""
        with self._jobs_lock:
            if self._jobs is None:
                self._jobs = JobsLoop(
                    self.store.live,
                    poll=self.settings.jobs_poll,
                    grace=self.settings.jobs_grace,
                    on_ignored=self.store.note_ignored_cancellation,
                    ended_feed=self.store.listen_ended,
                )
            return self._jobs

    @property
    def runs_many(self) -> bool:
        """Whether this process runs many jobs at once on a shared loop."""
        return self._jobs is not None

    def live_check(self, job_id: str) -> Callable[[], bool]:
        """How a running request asks whether its job is live: from the jobs loop's watch
        (no Redis read) when jobs share a loop, else a read of the job's status."""
        if shares_loop():
            return partial(self.jobs.is_live, job_id)
        return partial(self.job_live, job_id)

    def policy(self, backend: Backend) -> tuple[InferenceClient, ChatTemplater]:
        """The client and templater of `backend`, rebuilt if its URL, API or model changed
        (or it was made on another event loop)."""
        key = (
            f"{backend.kind}|{backend.api}|{backend.url}|{backend.model}|{backend.tokenizer}"
            f"|{hash(backend.api_key)}"
        )
        with contextlib.suppress(RuntimeError):
            key += f"|{id(asyncio.get_running_loop())}"
        cached = self._clients.get(backend.id)
        if cached is None or cached[0] != key:
            client = make_client(
                backend.kind,
                backend.api,
                backend.url,
                backend.model,
                timeout=self.settings.backend_timeout,
                retries=self.settings.backend_retries,
                tokenizer=backend.tokenizer,
                api_key=backend.api_key,
            )
            if cached is not None:
                _close_later(cached[1], self.settings.backend_timeout + CLOSE_MARGIN)
            cached = (key, client, ChatTemplater(client))
            self._clients[backend.id] = cached
        return cached[1], cached[2]

    def job_live(self, job_id: str) -> bool:
        """Whether the job has not reached a final status (a missing job is not live)."""
        try:
            return not self.store.status(job_id).terminal
        except JobNotFound:
            return False

    @property
    def dispatcher(self) -> Dispatcher:
        """Sends and stops jobs for this process; built on first use."""
        if self._dispatcher is None:
            self._dispatcher = Dispatcher(
                self.store,
                self.pool,
                self.celery or get_celery(),
                self.settings.node_name,
                self.settings.cancel_grace,
                self.settings.broker_send_timeout,
            )
        return self._dispatcher

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        trajectory: Trajectory | None = None,
        error: StageError | None = None,
    ) -> bool:
        """Record the job's end exactly once and follow up what it set in motion (the groups
        a dynamic batch drew are sent, the rest of a batch whose target it met is cancelled)."""
        return self.dispatcher.finish(job_id, status, trajectory, error)

    def end_job(self, job_id: str, status: JobStatus, error: StageError | None) -> bool:
        """End a job that will not complete (keeping its partial trajectory) and free what it
        holds."""
        try:
            return self.finish(job_id, status, error=error)
        finally:
            self.free(job_id)

    def free(self, job_id: str, task_id: str = "") -> None:
        """Free what the job holds here: its backend slot, its sandbox when it lives on this
        node (the reaper covers other nodes) and, with `task_id`, that stage task's mark."""
        free(self.store, self.pool, self.settings.node_name, [job_id], task_id=task_id)

    def release_sandbox(self, job_id: str) -> None:
        """Stop the job's sandbox if it lives on this node (its stage is done with it)."""
        free(self.store, self.pool, self.settings.node_name, [job_id], slot=False)

    def _discard_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for backend_id, (key, client, _) in list(self._clients.items()):
            if key.endswith(f"|{id(loop)}"):  # made on this loop (not the jobs loop's)
                del self._clients[backend_id]
                with contextlib.suppress(Exception):
                    getattr(client, "discard", lambda: None)()
        with contextlib.suppress(Exception):
            loop.close()


CLOSE_MARGIN = 10.0
"""Seconds past the backend timeout after which a replaced client is closed."""


def _close_later(client: InferenceClient, after: float) -> None:
    """Close a replaced client's connections on the running loop once the requests it may
    still have in flight are over (`after` seconds: the backend timeout and a margin)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def close() -> None:
        task = loop.create_task(client.aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    loop.call_later(after, close)


_closing: set[asyncio.Task[None]] = set()
"""Closes in progress (the loop keeps only weak references to its tasks)."""


def shares_loop() -> bool:
    """Whether a stage called here runs its episode on the shared jobs loop: it was called
    from a pool thread (the threads pool of `--jobs N`), not a process's main thread (prefork
    children run their task there)."""
    return threading.current_thread() is not threading.main_thread()


_runtime: tuple[int, Runtime] | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """This process's runtime (made after fork: every prefork child builds its own)."""
    current = _runtime
    if current is not None and current[0] == os.getpid():
        return current[1]
    with _runtime_lock:
        return _make_runtime()


def _make_runtime() -> Runtime:
    global _runtime
    if _runtime is None or _runtime[0] != os.getpid():
        settings = get_settings()
        if not settings.redis_url:
            raise RuntimeError("ROLLSERVE_REDIS_URL is not set in the worker's environment")
        client = redis_client(settings.redis_url, settings.redis_retry_seconds)
        _runtime = (
            os.getpid(),
            Runtime(
                settings=settings,
                store=JobStore.for_settings(client, settings),
                pool=BackendPool(client, settings.key_prefix, settings.health_failures),
            ),
        )
    return _runtime[1]
