"""Who holds a job's running stage, heartbeats of workers and nodes, and taking a stage over.

A running stage's mark (`lua/stage_begin.lua`) names the worker holding it (`active_owner`,
the id its heartbeat is written under) and since when (`active_since`); every held stage is
indexed in the sorted set `{p}held`. Each worker process writes `{p}hb:w:{owner}` and, for
every stage it takes, `{p}hb:n:{node}:{stage}`, with a short time to live; a sandboxed job is
listed in `{p}pinned:{node}` while its box lives there (`{p}nodes` names every node seen).

A worker that receives a stage message notes it at once (`reserved`, `lua/reserve.lua`), so a
message waiting in a worker for a free pool process is not lost with that worker either.
A live job that holds no stage (just created, or a stage of it just ended) is indexed in
`{p}transit` until a worker notes its next stage's message, so the sweeper can find one whose
message was lost on the way (`{p}transit:missed` notes when a look found none).
A sweeper that finds a mark whose holder's heartbeat is gone takes the stage over with
`lua/claim.lua`: the job's `attempt` goes up by one and the mark becomes the sweeper's own,
pending until the stage is sent again and a worker begins it. Only one caller can take a
given mark, and a stage message of an earlier attempt is refused by `stage_begin`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from redis.commands.core import Script

from broker.jobstore.base import TERMINAL, StoreBase, lua, text
from core.schemas import STAGES, JobStatus

_FIELDS = (
    "status",
    "active",
    "active_owner",
    "active_since",
    "active_pending",
    "attempt",
    "sandbox",
    "sandbox_released",
    "agent",
    "task_ids",
    "data_source",
    "reserved",
    "reserved_owner",
    "reserved_since",
    *(f"dur_{stage}" for stage in STAGES),
)


@dataclass
class Holding:
    """What the sweeper needs to know of one job: its state, its stage mark and its box."""

    job_id: str
    status: JobStatus
    attempt: int
    task_ids: dict[str, str]
    data_source: str
    agent: dict[str, Any]
    task_id: str = ""
    """The running (or pending) stage task; empty when no stage of the job is held."""
    owner: str = ""
    since: float = 0.0
    pending: bool = False
    """The mark is a sweeper's: the stage was sent again and no worker has received it yet."""
    reserved: bool = False
    """No stage of the job runs, but a worker received the message of `task_id` (it waits
    for a pool process); `owner` and `since` are that worker's and the time it received it."""
    sandbox_host: str | None = None
    """The node of the job's live sandbox (None without one, or once it was released)."""
    spent: float = 0.0
    """Seconds of the stages the job finished."""
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def stage(self) -> str | None:
        """The stage of the held task (from the job's task ids), or None."""
        for stage, task_id in self.task_ids.items():
            if task_id == self.task_id:
                return stage
        return None


class Liveness(StoreBase):
    """Heartbeats, the index of held stages and pinned jobs, and the once-only takeover."""

    @cached_property
    def _claim(self) -> Script:
        return self.r.register_script(lua("claim"))

    @cached_property
    def _reserve(self) -> Script:
        return self.r.register_script(lua("reserve"))

    # ------------------------------------------------------------------ keys
    @property
    def held_key(self) -> str:
        return f"{self.p}held"

    def worker_beat_key(self, owner: str) -> str:
        return f"{self.p}hb:w:{owner}"

    def node_beat_key(self, node: str, stage: str) -> str:
        return f"{self.p}hb:n:{node}:{stage}"

    def _pinned(self, node: str) -> str:
        return f"{self.p}pinned:{node}"

    @property
    def _nodes(self) -> str:
        return f"{self.p}nodes"

    # ------------------------------------------------------------------ heartbeats
    def beat(self, owner: str, node: str, stages: list[str], ttl: float) -> None:
        """Say that the worker `owner` on `node`, taking `stages`, is alive for `ttl` seconds."""
        ms = max(1, int(ttl * 1000))
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.worker_beat_key(owner), "1", px=ms)
        for stage in stages:
            pipe.set(self.node_beat_key(node, stage), owner, px=ms)
        pipe.sadd(self._nodes, node)
        pipe.execute()

    def worker_alive(self, owner: str) -> bool:
        return bool(owner) and bool(self.r.exists(self.worker_beat_key(owner)))

    def node_alive(self, node: str, stage: str) -> bool:
        """Whether a worker on `node` that takes `stage` tasks is alive."""
        return bool(self.r.exists(self.node_beat_key(node, stage)))

    def nodes(self) -> list[str]:
        return sorted(text(n) for n in self.r.smembers(self._nodes))

    # ------------------------------------------------------------------ indexes
    def pin(self, job_id: str, node: str) -> None:
        """List the job among those whose sandbox lives on `node`."""
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self._pinned(node), job_id)
        pipe.sadd(self._nodes, node)
        pipe.execute()

    def unpin(self, job_id: str, node: str) -> None:
        self.r.srem(self._pinned(node), job_id)

    def pinned(self, node: str) -> list[str]:
        return [text(j) for j in self.r.smembers(self._pinned(node))]

    def held(self) -> list[str]:
        """Every job indexed as holding a stage, oldest first."""
        return [text(j) for j in self.r.zrange(self.held_key, 0, -1)]

    def forget_held(self, job_id: str) -> None:
        """Drop the job from the index of held stages (its record is gone, or holds none)."""
        self.r.zrem(self.held_key, job_id)

    # ------------------------------------------------------------------ jobs in transit
    @property
    def _missed(self) -> str:
        return f"{self.p}transit:missed"

    def in_transit(self, before: float, limit: int) -> list[str]:
        """Up to `limit` jobs waiting for their next stage's message since before `before`
        (Unix time), longest waiting first."""
        found = self.r.zrangebyscore(self.transit_key, "-inf", before, start=0, num=limit)
        return [text(j) for j in found]

    def still_in_transit(self, job_ids: Sequence[str], now: float) -> None:
        """The messages of these jobs were found waiting: look again after the others."""
        if job_ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.zadd(self.transit_key, dict.fromkeys(job_ids, now), xx=True)
            pipe.hdel(self._missed, *job_ids)
            pipe.execute()

    def forget_transit(self, job_ids: Sequence[str]) -> None:
        """Drop these jobs from the jobs in transit (ended, holding a stage, or sent again)."""
        if job_ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.zrem(self.transit_key, *job_ids)
            pipe.hdel(self._missed, *job_ids)
            pipe.execute()

    def missed(self, job_ids: Sequence[str], now: float) -> dict[str, float]:
        """Note that no message of these jobs was found at `now`; returns, for those already
        missed at an earlier look, when that was."""
        if not job_ids:
            return {}
        earlier = self.r.hmget(self._missed, list(job_ids))
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hsetnx(self._missed, job_id, now)
        pipe.execute()
        return {j: float(t) for j, t in zip(job_ids, earlier, strict=True) if t is not None}

    # ------------------------------------------------------------------ reads
    def holdings(self, job_ids: list[str]) -> dict[str, Holding]:
        """What the sweeper needs of each of these jobs that still exists (pipelined)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self._job(job_id), list(_FIELDS))
        out: dict[str, Holding] = {}
        for job_id, raw in zip(job_ids, pipe.execute(), strict=True):
            h = dict(zip(_FIELDS, (None if v is None else text(v) for v in raw), strict=True))
            if h["status"] is None:
                continue
            sandbox = json.loads(h["sandbox"]) if h["sandbox"] else None
            live_box = sandbox is not None and h["sandbox_released"] != "1"
            durations = {
                stage: float(h[f"dur_{stage}"] or 0) for stage in STAGES if h[f"dur_{stage}"]
            }
            reserved = not h["active"] and bool(h["reserved"])
            mark = "reserved" if reserved else "active"
            out[job_id] = Holding(
                job_id=job_id,
                status=JobStatus(h["status"]),
                attempt=int(h["attempt"] or 0),
                task_ids=json.loads(h["task_ids"] or "{}"),
                data_source=h["data_source"] or "",
                agent=json.loads(h["agent"] or "{}"),
                task_id=h[mark] or "",
                owner=h[f"{mark}_owner"] or "",
                since=float(h[f"{mark}_since"] or 0),
                pending=h["active_pending"] == "1" and not reserved,
                reserved=reserved,
                sandbox_host=str(sandbox.get("host")) if live_box and sandbox else None,
                spent=sum(durations.values()),
                durations=durations,
            )
        return out

    def reserve(self, job_id: str, task_id: str, owner: str, attempt: int) -> str:
        """Note that the worker `owner` received the job's stage message `task_id` (of
        `attempt`): `reserved`, or `ended`, `stale` (an earlier attempt's) or `missing`."""
        result = self._reserve(
            keys=[self._job(job_id), self.held_key, self.transit_key],
            args=[task_id, owner, time.time(), TERMINAL, attempt],
        )
        return {-1: "missing", 1: "reserved", 2: "stale"}.get(int(result), "ended")

    # ------------------------------------------------------------------ takeover
    def claim(
        self,
        holding: Holding,
        gone: str,
        send_task: str,
        where: str,
        owner: str,
        *,
        restart: bool = False,
        now: float | None = None,
    ) -> int:
        """Take over the job's stage as `holding` saw it, provided the heartbeat key `gone` is
        still missing: returns the job's new attempt, or 0 when another caller took it first,
        the job ended or its mark changed. With `restart`, the job starts again from INIT (its
        record forgets the sandbox and context of the lost attempt)."""
        pinned = self._pinned(holding.sandbox_host) if restart and holding.sandbox_host else ""
        result = self._claim(
            keys=[self._job(holding.job_id), self.held_key, gone, pinned, self.transit_key],
            args=[
                TERMINAL,
                "" if holding.reserved else holding.task_id,
                holding.attempt,
                send_task,
                where,
                owner,
                time.time() if now is None else now,
                "1" if restart else "",
            ],
        )
        return int(result)
