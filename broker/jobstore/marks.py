"""Stage marks and stop confirmation.

A running stage task marks its job (`active` in the job hash); a cancelled job of a batch is
confirmed stopped once no stage of it runs and its sandbox is released, and a cancelling
batch is done when every such job is (`lua/stage_end.lua`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from broker.jobstore.base import TERMINAL, text
from broker.jobstore.dynamic import Dynamic
from broker.jobstore.model import JobNotFound


class Marks(Dynamic):
    """Stage marks of jobs and the confirmation that cancelled ones stopped."""

    def stage_begin(self, job_id: str, task_id: str, where: str = "") -> bool:
        """Mark a stage task of the job as running; False (and no mark) if the job has ended.

        With the mark, a cancel waits for `stage_end` before it counts the job as stopped;
        without it, a cancel and a starting stage cannot both go on (one Lua script each).
        `where` (host|pid|process start time) lets the worker wait for a killed process.
        """
        return self.begin_stage(job_id, task_id, where) == "began"

    def begin_stage(
        self,
        job_id: str,
        task_id: str,
        where: str = "",
        owner: str = "",
        attempt: int | None = None,
    ) -> str:
        """`stage_begin` that also names the worker holding the stage (`owner`, its heartbeat
        id) and checks the message's `attempt`: returns `began`, `ended` (the job has ended)
        or `stale` (the message belongs to an earlier attempt, whose stage was taken over and
        sent again: it must be dropped without touching the job)."""
        result = self._stage_begin(
            keys=[self._job(job_id), f"{self.p}held", self.transit_key],
            args=[task_id, where, TERMINAL, owner, time.time(), "" if attempt is None else attempt],
        )
        if result == -1:
            raise JobNotFound(job_id)
        return {1: "began", 2: "stale"}.get(int(result), "ended")

    def stage_end(self, job_id: str, task_id: str = "", *, sandbox_released: bool = False) -> bool:
        """Clear the stage mark of `task_id` (if it is still that task's) and, with
        `sandbox_released`, record that the job's sandbox is gone; returns True if that made a
        cancelling batch done (every one of its cancelled jobs is confirmed stopped)."""
        result = self._stage_end(
            keys=[self._job(job_id)],
            args=[
                self.p,
                task_id,
                time.time(),
                "1" if sandbox_released else "",
                TERMINAL,
                self.stub_ttl,
            ],
        )
        return text(result) == "done"

    def sandbox_released(self, job_id: str) -> bool:
        """Record that the job's sandbox was stopped (see `stage_end`)."""
        return self.stage_end(job_id, "", sandbox_released=True)

    def stuck_stops(self, batch_id: str, older_than: float) -> list[str]:
        """Cancelled jobs of the batch still unconfirmed `older_than` seconds after their end."""
        members = [m for m in self.stopping(batch_id) if not m.startswith("~")]
        if not members:
            return []
        pipe = self.r.pipeline(transaction=False)
        for job_id in members:
            pipe.hget(self._job(job_id), "t_end")
        cutoff = time.time() - older_than
        ends = pipe.execute()
        return [j for j, t in zip(members, ends, strict=True) if t is None or float(t) < cutoff]

    def force_stopped(self, job_id: str) -> bool:
        """Take a cancelled job as stopped although nothing confirmed it (its worker is gone);
        True if that made its batch done."""
        active = self.active_stage(job_id)
        return self.stage_end(job_id, active[0] if active else "", sandbox_released=True)

    def active_tasks(self, job_ids: Sequence[str]) -> dict[str, str]:
        """The running stage task of each of these jobs that has one (pipelined reads)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self._job(job_id), "active")
        return {j: text(t) for j, t in zip(job_ids, pipe.execute(), strict=True) if t}

    def active_stage(self, job_id: str) -> tuple[str, str] | None:
        """The running stage task of the job and where it runs (host|pid|start), or None."""
        task_id, where = self.r.hmget(self._job(job_id), ["active", "active_at"])
        return (text(task_id), text(where or "")) if task_id else None
