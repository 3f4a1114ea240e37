"""Listing reads for the console: batches newest first, a batch's jobs page by page.

Batches are indexed at creation in the sorted set `{p}batches` (batch id by creation time),
trimmed to the record lifetime (`ttl`) whenever a batch is added; a batch whose hash has
expired is dropped from the index when a listing meets it. A page of jobs reads the page's
ids from the batch's job list and only `status`, `group_id` and the reward of those jobs, so a
batch of any size lists at the cost of one page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from broker.jobstore.base import StoreBase, text

FILTER_CHUNK = 1000
"""Job statuses read per round trip while filtering a batch's jobs by status."""


@dataclass
class JobRow:
    """One job of a batch as a listing shows it."""

    job_id: str
    status: str
    """The record's status, or `expired` when the record has left Redis."""
    group_id: str
    reward: float | None


@dataclass
class JobPage:
    """A page of a batch's jobs; `total` counts the jobs matching the filter, None when the
    filter was not run to the end of the batch (the page was full before)."""

    rows: list[JobRow]
    offset: int
    limit: int
    total: int | None
    more: bool


def index_batch(pipe: Any, prefix: str, batch_id: str, created_at: float, ttl: int) -> None:
    """Queue on `pipe` the writes that add a batch to the index of batches (and trim it)."""
    key = f"{prefix}batches"
    pipe.zadd(key, {batch_id: created_at})
    pipe.zremrangebyscore(key, "-inf", created_at - ttl)
    pipe.expire(key, ttl)


def unindex_batch(pipe: Any, prefix: str, batch_id: str) -> None:
    """Queue on `pipe` the removal of a deleted batch from the index of batches."""
    pipe.zrem(f"{prefix}batches", batch_id)


class Listing(StoreBase):
    """Batches newest first and a batch's jobs by page and status."""

    @property
    def _batches(self) -> str:
        return f"{self.p}batches"

    def batch_count(self) -> int:
        """Batches in the index (some may have expired since it was last read)."""
        self.r.zremrangebyscore(self._batches, "-inf", time.time() - self.ttl)
        return int(self.r.zcard(self._batches))

    def list_batches(self, offset: int, limit: int) -> list[dict[str, str]]:
        """The hashes of up to `limit` batches from `offset`, newest first."""
        ids = [text(x) for x in self.r.zrevrange(self._batches, offset, offset + limit - 1)]
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self._batch(batch_id))
        found: list[dict[str, str]] = []
        gone: list[str] = []
        for batch_id, raw in zip(ids, pipe.execute(), strict=True):
            if not raw:
                gone.append(batch_id)
                continue
            h = {text(k): text(v) for k, v in raw.items()}
            h.setdefault("batch_id", batch_id)
            found.append(h)
        if gone:
            self.r.zrem(self._batches, *gone)
        return found

    def batch_job_count(self, batch_id: str) -> int:
        return int(self.r.llen(self._batch_jobs(batch_id)))

    def _rows(self, ids: list[str]) -> list[JobRow]:
        """Status, group and reward of each of `ids` (two pipelined round trips)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self._job(job_id), ["status", "group_id"])
        heads = pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        for job_id, (_, group) in zip(ids, heads, strict=True):
            pipe.hget(self._group(text(group or "")), f"r:{job_id}")
        rewards = pipe.execute()
        rows = []
        for job_id, (status, group), reward in zip(ids, heads, rewards, strict=True):
            rows.append(
                JobRow(
                    job_id=job_id,
                    status=text(status) if status is not None else "expired",
                    group_id=text(group or ""),
                    reward=float(text(reward)) if reward is not None else None,
                )
            )
        return rows

    def batch_jobs_page(
        self, batch_id: str, offset: int, limit: int, status: str | None = None
    ) -> JobPage:
        """Jobs of the batch in submission order, `limit` from `offset`; with `status`, only
        the jobs in that status (their statuses are read a chunk at a time until the page
        is full, never the trajectories)."""
        key = self._batch_jobs(batch_id)
        if status is None:
            total = self.batch_job_count(batch_id)
            ids = [text(x) for x in self.r.lrange(key, offset, offset + limit - 1)]
            return JobPage(self._rows(ids), offset, limit, total, offset + len(ids) < total)
        matched: list[str] = []
        seen = 0
        start = 0
        while True:
            chunk = [text(x) for x in self.r.lrange(key, start, start + FILTER_CHUNK - 1)]
            if not chunk:
                break
            pipe = self.r.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hget(self._job(job_id), "status")
            for job_id, raw in zip(chunk, pipe.execute(), strict=True):
                if (text(raw) if raw is not None else "expired") != status:
                    continue
                if seen >= offset and len(matched) <= limit:
                    matched.append(job_id)
                seen += 1
            start += FILTER_CHUNK
            if len(matched) > limit:
                break
        more = len(matched) > limit
        rows = self._rows(matched[:limit])
        return JobPage(rows, offset, limit, None if more else seen, more)

    def batch_rewards(self, batch_id: str, last: int) -> list[tuple[str, str, float | None]]:
        """`(job id, group id, reward)` of the batch's `last` most recently finished jobs."""
        entries = self.r.xrevrange(self._batch_stream(batch_id), count=last)
        ids = []
        for _, fields in entries:
            value = fields.get(b"job_id", fields.get("job_id"))
            if value is not None:
                ids.append(text(value))
        return [(r.job_id, r.group_id, r.reward) for r in self._rows(ids)]
