"""Dynamic-sampling (DAPO) batches: creation, draws, cancellation passes, unsent jobs, the
stopping set.

The finish script (`lua/finish.lua`) does the drawing: when a job was the last of its group it
judges the group, draws the next groups and detects the target (see `lua/lib.lua`). Here are
the batch's creation and first draw, the cancellation passes and the stopping set (a cancelling
batch is done when it empties), the claims on drawn jobs whose sender died before sending, and
the batch's dynamic progress.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from broker.jobstore.base import StoreBase, text
from broker.jobstore.listing import index_batch, unindex_batch
from broker.jobstore.model import DynamicOptions, JobNotFound, PoolTask
from core.schemas import DynamicProgress, JobStatus


class Dynamic(StoreBase):
    """Dynamic batches and the stopping set of any batch."""

    # ------------------------------------------------------------------ creation
    def create_dynamic_batch(
        self,
        batch_id: str,
        pool: Sequence[PoolTask],
        options: DynamicOptions,
        samplings: Sequence[dict[str, Any]],
        agent: dict[str, Any],
        tenant: str = "",
    ) -> list[str]:
        """Write a dynamic batch (its pool, options and counters) and draw its first groups;
        returns their job ids (created, queued, not yet sent to Celery).

        `samplings[a]` is the sampling of a task's attempt `a` (one per allowed attempt).
        """
        if len(samplings) < options.max_attempts_per_task:
            raise ValueError("one sampling per allowed attempt is needed")
        now = time.time()
        bkey = self._batch(batch_id)
        spec: dict[str | bytes, str | int | float] = {"agent": json.dumps(agent)}
        for attempt, sampling in enumerate(samplings):
            spec[f"sampling:{attempt}"] = json.dumps(sampling)
        for index, item in enumerate(pool):
            spec[f"task:{index}"] = json.dumps(item.task)
            spec[f"ds:{index}"] = item.data_source
            spec[f"iid:{index}"] = item.instance_id
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            bkey,
            mapping={
                "batch_id": batch_id,
                "total": 0,
                "group_size": options.group_size,
                "groups_total": 0,
                "groups_finished": 0,
                "finished": 0,
                "created_at": now,
                "dynamic": 1,
                "state": "running",
                "target": options.target_groups,
                "inflight_max": options.max_inflight_groups,
                "attempts_max": options.max_attempts_per_task,
                "early_cancel": 1 if options.early_cancel else 0,
                "pool_size": len(pool),
                "groups_seq": 0,
                "groups_drawn": 0,
                "groups_inflight": 0,
                "tenant": tenant,
            },
        )
        pipe.hset(self._bkey(batch_id, "spec"), mapping=spec)
        pipe.rpush(self._bkey(batch_id, "draws"), *range(len(pool)))
        index_batch(pipe, self.p, batch_id, now, self.ttl)
        for key in (bkey, self._bkey(batch_id, "spec"), self._bkey(batch_id, "draws")):
            pipe.expire(key, self.ttl)
        pipe.execute()
        return [text(x) for x in self._draw(args=[self.p, batch_id, now])]

    def delete_batch(self, batch_id: str) -> None:
        """Undo `create_dynamic_batch` (its jobs are all still queued) when sending failed."""
        job_ids = [text(x) for x in self.r.lrange(self._batch_jobs(batch_id), 0, -1)]
        groups = {job_id.rsplit("-", 1)[0] for job_id in job_ids}
        tenant = text(self.r.hget(self._batch(batch_id), "tenant") or "")
        pipe = self.r.pipeline(transaction=True)
        if tenant and job_ids:
            pipe.srem(self._tenant_live(tenant), *job_ids)
        for job_id in job_ids:
            pipe.delete(self._job(job_id))
        for group_id in groups:
            pipe.delete(self._group(group_id))
        if job_ids:
            pipe.hincrby(self._counts, JobStatus.queued.value, -len(job_ids))
        parts = ("jobs", "spec", "draws", "attempts", "unsent", "accepted", "groups", "stopping")
        pipe.delete(self._batch(batch_id), *(self._bkey(batch_id, part) for part in parts))
        unindex_batch(pipe, self.p, batch_id)
        pipe.execute()

    def is_dynamic(self, batch_id: str) -> bool:
        return text(self.r.hget(self._batch(batch_id), "dynamic") or "") == "1"

    # ------------------------------------------------------------------ sending
    def mark_sent(self, batch_id: str, job_ids: Sequence[str]) -> None:
        """The Celery chains of these drawn jobs are sent."""
        if job_ids:
            self.r.zrem(self._bkey(batch_id, "unsent"), *job_ids)

    def claim_unsent(self, batch_id: str, older_than: float) -> list[str]:
        """Drawn jobs still unsent after `older_than` seconds (their sender died), claimed for
        sending by the caller (a second claim waits another `older_than`)."""
        now = time.time()
        claimed = self._claim_unsent(
            keys=[self._bkey(batch_id, "unsent")], args=[now - older_than, now]
        )
        return [text(x) for x in claimed]

    # ------------------------------------------------------------------ cancellation
    def cancel_begin(self, batch_id: str, token: str) -> bool:
        """A cancellation pass over the batch starts (a dynamic batch draws no more groups);
        the batch is not done until `cancel_end(token)`. False when it is over already."""
        result = self._cancel_begin(args=[self.p, batch_id, token, time.time()])
        if result == -1:
            raise JobNotFound(batch_id)
        return bool(result == 1)

    def cancel_end(self, batch_id: str, token: str) -> bool:
        """The cancellation pass `token` has cancelled every live job; True if the batch is
        done by that (every cancelled job confirmed stopped)."""
        return text(self._cancel_end(args=[self.p, batch_id, token, time.time()])) == "done"

    def stopping(self, batch_id: str) -> set[str]:
        """Cancelled jobs of the batch not yet confirmed stopped, and passes in progress."""
        return {text(x) for x in self.r.smembers(self._bkey(batch_id, "stopping"))}

    # ------------------------------------------------------------------ progress
    def _dynamic_progress(self, batch_id: str, h: dict[str, str]) -> DynamicProgress:
        pipe = self.r.pipeline(transaction=False)
        pipe.lrange(self._bkey(batch_id, "groups"), 0, -1)
        pipe.hgetall(self._bkey(batch_id, "attempts"))
        pipe.smembers(self._bkey(batch_id, "stopping"))
        groups, attempts, members = pipe.execute()
        drawn = {int(text(k)) for k, v in attempts.items() if int(v) > 0}
        created = float(h["created_at"])

        def count(name: str) -> int:
            return int(h.get(name, 0))

        def since(name: str) -> float | None:
            return float(h[name]) - created if h.get(name) else None

        return DynamicProgress(
            state=h["state"],  # type: ignore[arg-type]
            target_groups=count("target"),
            group_size=count("group_size"),
            max_inflight_groups=count("inflight_max"),
            max_attempts_per_task=count("attempts_max"),
            early_cancel=h.get("early_cancel") == "1",
            pool_size=count("pool_size"),
            groups_drawn=count("groups_drawn"),
            groups_in_flight=count("groups_inflight"),
            groups_accepted=count("groups_accepted"),
            groups_filtered=count("groups_filtered"),
            groups_failed=count("groups_failed"),
            groups_cancelled=count("groups_cancelled"),
            groups_surplus=count("groups_surplus"),
            rollouts_used=count("rollouts_used"),
            rollouts_filtered=count("rollouts_filtered"),
            rollouts_wasted=count("rollouts_wasted"),
            rollout_seconds_used=float(h.get("seconds_used", 0.0)),
            rollout_seconds_filtered=float(h.get("seconds_filtered", 0.0)),
            rollout_seconds_wasted=float(h.get("seconds_wasted", 0.0)),
            target_reached=bool(h.get("t_target")),
            time_to_target=since("t_target"),
            time_to_done=since("t_done"),
            unconfirmed_stops=sum(1 for m in members if not text(m).startswith("~")),
            accepted_groups=[text(g) for g in groups],
            tasks_never_drawn=[i for i in range(count("pool_size")) if i not in drawn],
        )
