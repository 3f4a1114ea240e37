"""Batches and groups: progress, the done test, and the streams of finished jobs."""

from __future__ import annotations

from collections.abc import Iterator

from broker.jobstore.base import text
from broker.jobstore.dynamic import Dynamic
from broker.jobstore.model import JobNotFound
from core.schemas import TERMINAL_STATUSES, BatchProgress


class Batches(Dynamic):
    """Batch progress and results, plain or dynamic."""

    def batch_exists(self, batch_id: str) -> bool:
        return bool(self.r.exists(self._batch(batch_id)))

    def batch_job_ids(self, batch_id: str) -> list[str]:
        if not self.batch_exists(batch_id):
            raise JobNotFound(batch_id)
        return [text(x) for x in self.r.lrange(self._batch_jobs(batch_id), 0, -1)]

    def batch_progress(self, batch_id: str) -> BatchProgress:
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self._batch(batch_id))
        pipe.scard(self._bkey(batch_id, "stopping"))
        raw, stopping = pipe.execute()
        if not raw:
            raise JobNotFound(batch_id)
        h = {text(k): text(v) for k, v in raw.items()}
        dynamic = self._dynamic_progress(batch_id, h) if h.get("dynamic") else None
        total = int(h["total"])
        finished = int(h.get("finished", 0))
        counts = {s.value: int(h.get(f"n_{s.value}", 0)) for s in TERMINAL_STATUSES}
        counts = {k: v for k, v in sorted(counts.items()) if v}
        counts["pending"] = total - finished
        reward_n = int(h.get("reward_n", 0))
        return BatchProgress(
            batch_id=batch_id,
            total=total,
            group_size=int(h["group_size"]),
            counts=counts,
            finished=finished,
            groups_total=int(h["groups_total"]),
            groups_finished=int(h.get("groups_finished", 0)),
            mean_reward=float(h["reward_sum"]) / reward_n if reward_n else None,
            done=dynamic.state == "done" if dynamic else finished >= total and not stopping,
            created_at=float(h["created_at"]),
            dynamic=dynamic,
        )

    def batch_done(self, batch_id: str) -> bool:
        """`batch_progress(batch_id).done`, in one cheap round trip."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(self._batch(batch_id), ["dynamic", "state", "finished", "total"])
        pipe.scard(self._bkey(batch_id, "stopping"))
        (dynamic, state, finished, total), stopping = pipe.execute()
        if total is None:
            raise JobNotFound(batch_id)
        if dynamic:
            return text(state) == "done"
        return int(finished or 0) >= int(total) and not stopping

    def batch_state(self, batch_id: str) -> dict[str, str]:
        """The batch's hash as text (empty if unknown)."""
        return {text(k): text(v) for k, v in self.r.hgetall(self._batch(batch_id)).items()}

    # ------------------------------------------------------------------ result streams
    def _results_stream(self, batch_id: str) -> str:
        """The batch's ordered log of result lines: every finished job of a plain batch (the
        `done` stream), the accepted groups' jobs of a dynamic one (`accepted`)."""
        if self.is_dynamic(batch_id):
            return self._bkey(batch_id, "accepted")
        return self._batch_stream(batch_id)

    def has_result_entry(self, batch_id: str, entry_id: str) -> bool:
        """Whether `entry_id` is a job's entry in the batch's log of result lines."""
        stream = self._results_stream(batch_id)
        entries = self.r.xrange(stream, min=entry_id, max=entry_id, count=1)
        return any(
            text(entry) == entry_id and (b"job_id" in fields or "job_id" in fields)
            for entry, fields in entries
        )

    def iter_finished(
        self, batch_id: str, block_ms: int = 1000, idle: Iterator[None] | None = None
    ) -> Iterator[str | None]:
        """Job ids of the batch as they finish (in finishing order), until all have.

        Yields None after each `block_ms` without news, so a streaming caller can send a
        keep-alive or notice that its client went away.
        """
        for item in self.iter_results(batch_id, block_ms=block_ms):
            yield None if item is None else item[1]

    def iter_results(
        self, batch_id: str, after: str | None = None, block_ms: int = 1000
    ) -> Iterator[tuple[str, str] | None]:
        """`(entry id, job id)` of each result line of the batch, in the order of its log,
        from the entry after `after` (from the first without it) until the batch has no more.

        A plain batch's lines are its finished jobs, in finishing order, and end when all
        have finished; a dynamic batch's are the jobs of each accepted group, and end when
        the batch is done. Entry ids are those of the Redis stream the finish script appends
        to exactly once per line, so they stay valid across readers and gateway restarts.
        Yields None after each `block_ms` without news, so a streaming caller can send a
        keep-alive or notice that its client went away.
        """
        last = after or "0-0"
        if self.is_dynamic(batch_id):
            yield from self._iter_accepted(batch_id, block_ms, last)
            return
        total = self.batch_progress(batch_id).total
        stream = self._batch_stream(batch_id)
        while True:
            # One snapshot: the entries past `last` and how many there are in all, so the
            # stream is known complete only once every entry of it has been read.
            pipe = self.r.pipeline(transaction=True)
            pipe.xrange(stream, min=f"({last}", count=500)
            pipe.xlen(stream)
            entries, length = pipe.execute()
            if not entries:
                if length >= total:
                    return
                answer = self.r.xread({stream: last}, block=block_ms, count=500)
                if not answer:
                    yield None
                    continue
                entries = answer[0][1]
            for entry_id, fields in entries:
                last = text(entry_id)
                yield last, text(fields[b"job_id"] if b"job_id" in fields else fields["job_id"])

    def _iter_accepted(
        self, batch_id: str, block_ms: int, last: str = "0-0"
    ) -> Iterator[tuple[str, str] | None]:
        """A dynamic batch's accepted jobs past entry `last`, group by group, until the batch
        is done."""
        stream = self._bkey(batch_id, "accepted")
        while True:
            answer = self.r.xread({stream: last}, block=block_ms, count=500)
            if not answer:
                if not self.batch_exists(batch_id):
                    return  # expired or deleted under us
                yield None
                continue
            for entry_id, raw in answer[0][1]:
                last = text(entry_id)
                fields = {text(k): text(v) for k, v in raw.items()}
                if "end" in fields:
                    return
                yield last, fields["job_id"]
