"""Sending jobs to Celery and stopping them: plain functions the gateway and the workers share.

The gateway sends the jobs it creates and cancels on request; a worker whose job's end drew
new groups for a dynamic batch sends them, and the worker whose job met the batch's target
cancels the rest. Both go through one `Dispatcher`, and every end the service records goes
through `Dispatcher.finish`, so what an end sets in motion is followed up wherever it happens.

Cancelling a job records it `cancelled` (exactly once, in the job store), revokes its queued
stage tasks (dropped when a worker receives them), gives back its backend slot, stops its
sandbox — here when it lives on this node, otherwise by a broadcast to the workers of its
node (`rollserve_release`, see `workers/lifecycle.py`) — and gives its running stage
`ROLLSERVE_CANCEL_GRACE` seconds to stop by itself (RUN notices within one turn, and its pool
process lives on) before revoking it with `terminate=True`, which kills it on the prefork
pool. The batch counts the job as stopped once no stage of it runs and its sandbox is gone.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.exceptions import LimitExceeded

from broker.celery_app import send_job, send_stage
from broker.jobstore import (
    FinishOutcome,
    JobNotFound,
    JobRecord,
    JobSpec,
    JobStore,
    stage_task_ids,
)
from core.schemas import JobStatus, StageError, Trajectory
from routing.pool import BackendPool
from workers.holdings import free

log = logging.getLogger(__name__)

RELEASE_COMMAND = "rollserve_release"
"""The worker remote-control command that stops the sandboxes of ended jobs on its node."""

TARGET_TOKEN = "~target"
"""The stopping-set token of the cancellation that follows a dynamic batch's target."""

SEND_CHUNK = 200
"""Jobs published per producer acquisition: a large batch lets other senders in between."""

UNSENT_GRACE = 60.0
"""Seconds a drawn job may stay unsent before `recover` presumes its sender died."""


class DispatchError(RuntimeError):
    """The broker did not take the jobs."""


@dataclass
class Dispatcher:
    """Sends and stops jobs for one process (a worker, the gateway)."""

    store: JobStore
    pool: BackendPool
    celery: Celery
    node_name: str
    """This process's node: sandboxes recorded on it are stopped directly."""
    grace: float = 1.0
    """Seconds a cancelled job's running stage gets to stop by itself before it is killed."""
    send_timeout: float = 30.0
    """Seconds a sender waits for a connection to the broker before giving up."""

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        trajectory: Trajectory | None = None,
        error: StageError | None = None,
    ) -> bool:
        """Record the job's end exactly once (False when it had ended already) and follow up
        what it set in motion: the groups it drew are sent, the rest of a batch whose target
        it met is cancelled."""
        outcome = self.store.finish_outcome(job_id, status, trajectory, error)
        if outcome.new_jobs or outcome.event == "target":
            try:
                self.follow_up(outcome)
            except Exception:
                # The end is recorded; unsent jobs are sent again by `recover` later.
                log.exception("follow-up of job %s's end failed", job_id)
        return outcome.recorded

    # ------------------------------------------------------------------ sending
    def send(
        self, job_ids: Sequence[str], task_ids: dict[str, dict[str, str]] | None = None
    ) -> None:
        """Send each job's chain `init → run → eval` (task ids from `task_ids`, else derived
        from the job id).

        Each chunk of jobs is published on one broker connection taken from the app's pool
        for that chunk only, and nothing else is taken while it is held, so any number of
        concurrent senders share the pool without waiting on each other for good. A sender
        that gets no connection within `send_timeout` seconds (the broker is saturated or
        gone) gets a `DispatchError`.
        """
        for start in range(0, len(job_ids), SEND_CHUNK):
            chunk = job_ids[start : start + SEND_CHUNK]
            with self._producer() as producer:
                for job_id in chunk:
                    ids = (task_ids or {}).get(job_id) or stage_task_ids(job_id)
                    send_job(self.celery, job_id, ids, producer)

    def send_again(
        self,
        job_id: str,
        task_ids: dict[str, str],
        stage: str,
        attempt: int,
        queues: dict[str, str] | None = None,
    ) -> None:
        """Send the job's `stage` and the stages after it again, as attempt `attempt` (the
        sweeper's takeover of a stage whose worker or node died)."""
        with self._producer() as producer:
            send_stage(self.celery, job_id, task_ids, stage, attempt, producer, queues)

    @contextlib.contextmanager
    def _producer(self) -> Iterator[Any]:
        """A producer on one broker connection from the app's pool, held for the block only;
        `DispatchError` when none comes free within `send_timeout` seconds."""
        try:
            connection = self.celery.pool.acquire(block=True, timeout=self.send_timeout)
        except LimitExceeded:
            raise DispatchError(
                f"the broker is saturated: no connection to it came free within "
                f"{self.send_timeout:g}s (ROLLSERVE_BROKER_SEND_TIMEOUT); try again"
            ) from None
        with connection:
            yield self.celery.amqp.Producer(connection)

    def enqueue_specs(
        self, specs: Sequence[JobSpec], batch_id: str | None, group_size: int, tenant: str = ""
    ) -> None:
        """Create the jobs and send them; on a broker error nothing of them is left (chains
        sent before the error find no job and are dropped by the workers)."""
        self.store.create_jobs(specs, batch_id=batch_id, group_size=group_size, tenant=tenant)
        try:
            self.send([s.job_id for s in specs], {s.job_id: s.task_ids for s in specs})
        except Exception as exc:
            log.exception("enqueueing %d jobs failed", len(specs))
            self.store.delete_jobs(specs, batch_id, tenant)
            raise DispatchError(f"the broker did not take the jobs: {exc}") from exc

    def send_drawn(self, batch_id: str, job_ids: Sequence[str]) -> None:
        """Send jobs a dynamic batch drew (created by the job store) and note them sent."""
        self.send(job_ids)
        self.store.mark_sent(batch_id, job_ids)

    def follow_up(self, outcome: FinishOutcome) -> None:
        """After a job's end: send the groups it drew; cancel the rest if it met the target."""
        if outcome.batch_id is None:
            return
        if outcome.new_jobs:
            self.send_drawn(outcome.batch_id, outcome.new_jobs)
        if outcome.event == "target":
            target = self.store.batch_state(outcome.batch_id).get("target", "?")
            self.cancel_batch(
                outcome.batch_id,
                f"cancelled: the batch met its target of {target} informative groups",
                token=TARGET_TOKEN,
            )

    # ------------------------------------------------------------------ stopping
    def cancel_jobs(
        self, job_ids: Sequence[str], message: str = "cancelled by request"
    ) -> list[str]:
        """Cancel the live jobs among `job_ids`; returns those this call cancelled."""
        cancelled: list[JobRecord] = []
        for job_id in self.store.live_job_ids(job_ids):
            try:
                record = self.store.get(job_id, task=False)
            except JobNotFound:
                continue
            if record.status.terminal:
                continue
            error = StageError(stage=record.status.value, type="cancelled", message=message)
            if self.finish(job_id, JobStatus.cancelled, error=error):
                cancelled.append(record)
        if not cancelled:
            return []
        # Queued stage tasks are dropped when a worker receives them. A running stage (its
        # mark, read after the cancel: none can begin any more) gets `grace` seconds to stop by
        # itself — RUN notices within one turn and keeps its pool process — then it is killed.
        running = self.store.active_tasks([r.job_id for r in cancelled])
        marked = set(running.values())
        self.celery.control.revoke(
            [t for r in cancelled for t in r.task_ids.values() if t not in marked]
        )
        self.free([r.job_id for r in cancelled])
        deadline = time.monotonic() + self.grace
        while running and time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.store.active_tasks(list(running))
            running = {j: t for j, t in running.items() if now.get(j) == t}
        if running:
            # Only still-marked tasks: Celery terminates by pid, and a process that finished
            # the task a moment ago may run another job's stage now.
            tasks = sorted(running.values())
            self.celery.control.revoke(tasks, terminate=True, signal="SIGTERM")
        return [r.job_id for r in cancelled]

    def free(self, job_ids: Sequence[str]) -> None:
        """Free what these ended jobs hold: backend slots, and sandboxes — here when they live
        on this node, elsewhere through the release broadcast to their node's workers."""
        free(
            self.store,
            self.pool,
            self.node_name,
            job_ids,
            elsewhere=lambda remote: self.celery.control.broadcast(
                RELEASE_COMMAND, arguments={"job_ids": remote}
            ),
        )

    def cancel_batch(
        self, batch_id: str, message: str = "cancelled by request", token: str | None = None
    ) -> list[str]:
        """Stop all work of the batch: a dynamic batch draws nothing more, every live job is
        cancelled. Returns the jobs this call cancelled."""
        dynamic = self.store.is_dynamic(batch_id)
        token = token or f"~cancel:{uuid.uuid4().hex}"
        if dynamic and not self.store.cancel_begin(batch_id, token):
            return []  # done already
        try:
            return self.cancel_jobs(self.store.batch_job_ids(batch_id), message)
        finally:
            if dynamic:
                self.store.cancel_end(batch_id, token)

    def recover(
        self, batch_id: str, older_than: float = UNSENT_GRACE, stuck_after: float | None = None
    ) -> None:
        """Finish what a worker that died left of a batch: drawn jobs it never sent, a target
        cancellation it never completed, and — `stuck_after` seconds after their cancel, when
        every stage has passed its hard time limit — stops nobody confirmed. Safe any time."""
        if stuck_after is not None:
            stuck = self.store.stuck_stops(batch_id, stuck_after)
            if stuck:
                log.warning("batch %s: taking %d unconfirmed stops as done", batch_id, len(stuck))
                self.free(stuck)
                for job_id in stuck:
                    self.store.force_stopped(job_id)
        claimed = self.store.claim_unsent(batch_id, older_than)
        if claimed:
            live = [j for j in claimed if not self.store.status(j).terminal]
            log.warning("batch %s: sending %d drawn jobs left unsent", batch_id, len(live))
            self.send(live)
            self.store.mark_sent(batch_id, claimed)
        state = self.store.batch_state(batch_id)
        if (
            state.get("state") == "cancelling"
            and TARGET_TOKEN in self.store.stopping(batch_id)
            and state.get("t_target")
            and _age(state["t_target"]) > older_than
        ):
            log.warning("batch %s: completing the cancellation after its target", batch_id)
            self.follow_up(FinishOutcome("", True, batch_id=batch_id, event="target"))


def _age(timestamp: str) -> float:
    return time.time() - float(timestamp)
