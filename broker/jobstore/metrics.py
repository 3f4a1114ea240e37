"""Metrics: job counts by status, stage-duration histograms, throughput."""

from __future__ import annotations

import time

from broker.jobstore.base import StoreBase, text
from core.schemas import JobStatus

# Upper bounds (seconds) of the stage-duration histogram buckets.
STAGE_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
)


class Metrics(StoreBase):
    """Counters and histograms over all jobs."""

    def stage_finished(self, job_id: str, stage: str, seconds: float) -> None:
        """Add `seconds` to the job's time in `stage` and to the stage histogram."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrbyfloat(self._job(job_id), f"dur_{stage}", seconds)
        hist = self._hist(stage)
        for bound in STAGE_BUCKETS:
            if seconds <= bound:
                pipe.hincrby(hist, f"le:{bound}", 1)
        pipe.hincrby(hist, "count", 1)
        pipe.hincrbyfloat(hist, "sum", seconds)
        pipe.execute()

    def status_counts(self) -> dict[str, int]:
        raw = self.r.hgetall(self._counts)
        counts = {s.value: 0 for s in JobStatus}
        counts.update({text(k): int(v) for k, v in raw.items()})
        return counts

    def finished_since(self, since: float) -> int:
        self.r.zremrangebyscore(self._done, "-inf", time.time() - 3600)
        return int(self.r.zcount(self._done, since, "+inf"))

    def stage_histogram(self, stage: str) -> tuple[list[tuple[float, int]], int, float]:
        """Cumulative (bound, count) buckets, total count and sum of seconds for `stage`."""
        raw = {text(k): text(v) for k, v in self.r.hgetall(self._hist(stage)).items()}
        buckets = [(b, int(raw.get(f"le:{b}", 0))) for b in STAGE_BUCKETS]
        return buckets, int(raw.get("count", 0)), float(raw.get("sum", 0.0))

    def note_ignored_cancellation(self, job_id: str) -> None:
        """Count a job whose task on a many-jobs worker went on after it was cancelled."""
        self.r.incr(f"{self.p}ignored_cancellations")

    def ignored_cancellations(self) -> int:
        """How many jobs ignored their cancellation (`note_ignored_cancellation`)."""
        return int(self.r.get(f"{self.p}ignored_cancellations") or 0)
