"""Job records and trajectories: creation and deletion, reads, state transitions, the end.

Every write that decides a job's fate is one Lua script (`lua/transition.lua`,
`lua/save_partial.lua`, `lua/finish.lua`), so a stage that runs twice (after a redelivery) or
a cancel racing a finishing worker cannot record a job twice. How trajectories are kept, and
moved to the results store at the end, is in `trajectories`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from broker.jobstore.base import TERMINAL, text
from broker.jobstore.listing import index_batch, unindex_batch
from broker.jobstore.model import FinishOutcome, JobNotFound, JobRecord, JobSpec
from broker.jobstore.trajectories import Trajectories, offload_due
from core.schemas import STAGES, JobStatus, StageError, Timing, Trajectory

log = logging.getLogger(__name__)
LIVE_CHUNK = 2000
"""Jobs read by one `live` script: Redis runs nothing else meanwhile (about 0.5 ms)."""


class Records(Trajectories):
    """Job records and trajectories."""

    def job_key(self, job_id: str) -> str:
        """The Redis hash of the job's record (its `status` field says where it is)."""
        return self._job(job_id)

    # ------------------------------------------------------------------ creation
    def create_jobs(
        self,
        specs: Sequence[JobSpec],
        *,
        batch_id: str | None = None,
        group_size: int = 1,
        tenant: str = "",
    ) -> None:
        """Write all job records (and the batch's) in one transaction, status `queued`.

        A batch's task is stored once per group (in the group's hash), not in every job of
        it. With a `tenant`, the jobs count against its unfinished jobs until they end."""
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        groups: dict[str, int] = {}
        group_tasks: dict[str, str] = {}
        for spec in specs:
            groups[spec.group_id] = groups.get(spec.group_id, 0) + 1
            if batch_id is not None:
                if spec.group_id not in group_tasks:  # serialised once per group
                    group_tasks[spec.group_id] = json.dumps(spec.task)
                where: dict[str | bytes, str] = {
                    "task_key": self._group(spec.group_id),
                    "task_field": "task_json",
                }
            else:
                where = {"task": json.dumps(spec.task)}
            pipe.hset(
                self._job(spec.job_id),
                mapping={
                    **where,
                    "tenant": tenant,
                    "job_id": spec.job_id,
                    "status": JobStatus.queued.value,
                    "data_source": spec.data_source,
                    "instance_id": spec.instance_id,
                    "group_id": spec.group_id,
                    "sample_index": spec.sample_index,
                    "batch_id": spec.batch_id or "",
                    "sampling": json.dumps(spec.sampling),
                    "agent": json.dumps(spec.agent),
                    "task_ids": json.dumps(spec.task_ids),
                    "created_at": now,
                    "t_queued": now,
                },
            )
            pipe.expire(self._job(spec.job_id), self.ttl)
        if specs:
            pipe.zadd(self.transit_key, {s.job_id: now for s in specs})
        pipe.hincrby(self._counts, JobStatus.queued.value, len(specs))
        if tenant and specs:
            pipe.sadd(self._tenant_live(tenant), *[s.job_id for s in specs])
            pipe.expire(self._tenant_live(tenant), self.ttl)
        if batch_id is not None:
            pipe.hset(
                self._batch(batch_id),
                mapping={
                    "batch_id": batch_id,
                    "total": len(specs),
                    "group_size": group_size,
                    "groups_total": len(groups),
                    "groups_finished": 0,
                    "finished": 0,
                    "created_at": now,
                },
            )
            pipe.rpush(self._batch_jobs(batch_id), *[s.job_id for s in specs])
            index_batch(pipe, self.p, batch_id, now, self.ttl)
            for key in (self._batch(batch_id), self._batch_jobs(batch_id)):
                pipe.expire(key, self.ttl)
            for group_id, size in groups.items():
                pipe.hset(
                    self._group(group_id),
                    mapping={"size": size, "finished": 0, "task_json": group_tasks[group_id]},
                )
                pipe.expire(self._group(group_id), self.ttl)
        pipe.execute()

    def delete_jobs(
        self, specs: Iterable[JobSpec], batch_id: str | None = None, tenant: str = ""
    ) -> None:
        """Undo `create_jobs` when enqueueing failed, so nothing half-made is left behind."""
        specs = list(specs)
        pipe = self.r.pipeline(transaction=True)
        for spec in specs:
            pipe.delete(self._job(spec.job_id))
        if specs:
            pipe.zrem(self.transit_key, *[s.job_id for s in specs])
        pipe.hincrby(self._counts, JobStatus.queued.value, -len(specs))
        if tenant and specs:
            pipe.srem(self._tenant_live(tenant), *[s.job_id for s in specs])
        if batch_id is not None:
            pipe.delete(self._batch(batch_id), self._batch_jobs(batch_id))
            unindex_batch(pipe, self.p, batch_id)
            for group_id in {s.group_id for s in specs}:
                pipe.delete(self._group(group_id))
        pipe.execute()

    # ------------------------------------------------------------------ reads
    def get(self, job_id: str, *, task: bool = True) -> JobRecord:
        """The job's record; with `task=False` its `task` is left empty (one read less)."""
        raw = self.r.hgetall(self._job(job_id))
        if not raw:
            raise JobNotFound(job_id)
        h = {text(k): text(v) for k, v in raw.items()}
        if not task:
            h["task"] = "{}"
        elif "task" not in h:
            # stored once for the job's group (or a dynamic batch's pool); gone only when
            # the record has outlived it
            h["task"] = text(self.r.hget(h.get("task_key", ""), h.get("task_field", "")) or "{}")
        times = {k[2:]: float(v) for k, v in h.items() if k.startswith("t_") and v}
        durations = {k[4:]: float(v) for k, v in h.items() if k.startswith("dur_") and v}
        return JobRecord(
            job_id=h["job_id"],
            status=JobStatus(h["status"]),
            task=json.loads(h["task"]),
            data_source=h["data_source"],
            instance_id=h["instance_id"],
            group_id=h["group_id"],
            sample_index=int(h.get("sample_index", 0)),
            batch_id=h.get("batch_id") or None,
            sampling=json.loads(h["sampling"]),
            agent=json.loads(h["agent"]),
            task_ids=json.loads(h["task_ids"]),
            created_at=float(h["created_at"]),
            times=times,
            durations=durations,
            backend_id=h.get("backend_id") or None,
            policy_version=int(h["policy_version"]) if h.get("policy_version") else None,
            error=StageError.model_validate_json(h["error"]) if h.get("error") else None,
            context=json.loads(h["context"]) if h.get("context") else None,
            sandbox=json.loads(h["sandbox"]) if h.get("sandbox") else None,
            hosts={k[5:]: v for k, v in h.items() if k.startswith("host_")},
            result=h.get("result") or None,
            attempt=int(h.get("attempt") or 0),
        )

    def live_job_ids(self, job_ids: Iterable[str]) -> list[str]:
        """Those of `job_ids` that exist and have not ended, in order (pipelined reads)."""
        ids = list(job_ids)
        live: list[str] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            pipe = self.r.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hget(self._job(job_id), "status")
            for job_id, raw in zip(chunk, pipe.execute(), strict=True):
                if raw is not None and not JobStatus(text(raw)).terminal:
                    live.append(job_id)
        return live

    def unfinished(self, tenant: str, recount: bool = False) -> int:
        """How many of the tenant's jobs have not ended. With `recount`, jobs whose record
        expired or was deleted without an end are dropped from the count first."""
        key = self._tenant_live(tenant)
        if recount:
            members = [text(m) for m in self.r.sscan_iter(key, count=1000)]
            for start in range(0, len(members), 1000):
                chunk = members[start : start + 1000]
                alive = self.live(chunk)
                gone = [m for m in chunk if m not in alive]
                if gone:
                    self.r.srem(key, *gone)
        return int(self.r.scard(key))

    def status(self, job_id: str) -> JobStatus:
        raw = self.r.hget(self._job(job_id), "status")
        if raw is None:
            raise JobNotFound(job_id)
        return JobStatus(text(raw))

    def live(self, job_ids: Iterable[str]) -> set[str]:
        """Those of `job_ids` whose record exists and has not reached a final status (one
        script per `LIVE_CHUNK` ids, answering with the few that ended: a many-jobs worker
        asks this about every job in flight twice a second)."""
        ids = list(job_ids)
        live = set(ids)
        for start in range(0, len(ids), LIVE_CHUNK):
            chunk = ids[start : start + LIVE_CHUNK]
            ended = self._ended(keys=[self._job(j) for j in chunk], args=[TERMINAL])
            live.difference_update(chunk[int(i) - 1] for i in ended)
        return live

    @property
    def ended_channel(self) -> str:
        """The pub/sub channel `lua/finish.lua` publishes each ended job's id on."""
        return f"{self.p}ended"

    def listen_ended(self, on_ended: Callable[[str], None], stop: threading.Event) -> None:
        """Call `on_ended(job_id)` for every job that ends from now on, until `stop` is set
        (blocking: run it on a thread of its own). Pub/sub delivers at most once: ends
        published while the connection is down are lost, so a caller keeps a slower poll
        (`live`) as well. A lost connection is made again, after a pause that grows."""
        pause = 0.1
        while not stop.is_set():
            pubsub = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.ended_channel)
                pause = 0.1
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        on_ended(text(message["data"]))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("the feed of ended jobs lost Redis (%s); again in %.1fs", exc, pause)
                stop.wait(pause)
                pause = min(5.0, pause * 2)
            finally:
                pubsub.close()

    def trajectory(self, job_id: str) -> Trajectory:
        """The job's trajectory: final once it has ended (from the results store once it
        moved there), partial so far while it runs, or a skeleton from the record. A job
        whose record has left Redis is looked for in the results store by id."""
        traj: Trajectory | None = None
        for _ in range(3):
            try:
                record = self.get(job_id, task=False)
            except JobNotFound:
                found = self.stored_result(job_id, None)
                if found is None:
                    raise
                return found
            if record.result is not None:
                traj = self.stored_result(job_id, record.result)
                if traj is None:
                    log.warning(
                        "job %s: its finished trajectory is not in the results store", job_id
                    )
                break
            traj = self.stored_trajectory(job_id)
            if traj is not None or not record.status.terminal:
                break
            # Ended, and its trajectory left Redis between the two reads (moved to the
            # results store at its end): the record now says where it went.
        if traj is None:
            traj = self.skeleton(record)
        # The record is authoritative for status, error and timing; the trajectory may lag it.
        traj.status = record.status
        if record.error is not None:
            traj.error = record.error
        traj.timing = self.timing(record, traj.timing)
        traj.finished_at = record.times.get("end")
        traj.hosts = record.hosts
        if offload_due(record.status.terminal, traj.finished_at, record.result is not None):
            self.offload(job_id, traj, traj.finished_at or time.time())
        return traj

    def skeleton(self, record: JobRecord) -> Trajectory:
        """An empty trajectory carrying the job's ids."""
        return Trajectory(
            job_id=record.job_id,
            group_id=record.group_id,
            batch_id=record.batch_id,
            instance_id=record.instance_id,
            data_source=record.data_source,
            sample_index=record.sample_index,
            status=record.status,
            backend_id=record.backend_id,
            policy_version=record.policy_version,
            created_at=record.created_at,
            error=record.error,
        )

    @staticmethod
    def timing(record: JobRecord, base: Timing | None = None) -> Timing:
        """Stage seconds from the record; queue time is the rest of the job's wall time."""
        timing = (base or Timing()).model_copy()
        for stage in STAGES:
            if stage in record.durations:
                setattr(timing, stage, record.durations[stage])
        end = record.times.get("end")
        if end is not None:
            in_stages = sum(record.durations.get(s, 0.0) for s in STAGES)
            timing.queue = max(0.0, end - record.created_at - in_stages)
        return timing

    # ------------------------------------------------------------------ writes
    def transition(self, job_id: str, status: JobStatus, host: str = "") -> bool:
        """Move a live job to `status`, noting the `host` that runs the stage; False if it is
        finished already (or already there)."""
        result = self._transition(
            keys=[self._job(job_id), self._counts],
            args=[status.value, time.time(), TERMINAL, host],
        )
        if result == -1:
            raise JobNotFound(job_id)
        return bool(result == 1)

    def session_address(self, job_id: str, marker: str) -> tuple[JobStatus, str | None]:
        """A session job's status and the address its RUN serves the session at (None while
        it is not served). A job whose `agent` lacks `marker` is no session: JobNotFound."""
        status, url, agent = self.r.hmget(self._job(job_id), ["status", "session_url", "agent"])
        if status is None or agent is None or marker not in json.loads(agent):
            raise JobNotFound(job_id)
        return JobStatus(text(status)), (text(url) or None) if url else None

    def set_fields(self, job_id: str, **fields: Any) -> None:
        """Record side facts of a live job (backend, policy version, context)."""
        mapping: dict[str | bytes, str | int | float] = {
            k: json.dumps(v) if isinstance(v, dict | list) else ("" if v is None else v)
            for k, v in fields.items()
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._job(job_id), mapping=mapping)
        if "sandbox" in fields:  # a new box (e.g. a redelivered INIT's) is not released yet
            pipe.hdel(self._job(job_id), "sandbox_released")
            # and what was saved of an episode in another box is not one to go on with
            # (workers.resume): the episode starts again in this one
            pipe.delete(self._traj(job_id), self._turns(job_id), self._sums(job_id))
        pipe.execute()

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        trajectory: Trajectory | None = None,
        error: StageError | None = None,
    ) -> bool:
        """Record the job's end exactly once. Returns False when it had already ended.

        Without a trajectory, the partial one stored so far (or an empty one) is kept. What the
        end set in motion for a dynamic batch (groups drawn, the target met) is left to the
        caller: `finish_outcome` returns it, and the workers' dispatcher follows it up.
        """
        return self.finish_outcome(job_id, status, trajectory, error).recorded

    def finish_outcome(
        self,
        job_id: str,
        status: JobStatus,
        trajectory: Trajectory | None = None,
        error: StageError | None = None,
    ) -> FinishOutcome:
        """`finish` without the follow-up: what the end set in motion is returned."""
        if not status.terminal:
            raise ValueError(f"{status} is not a final status")
        record = self.get(job_id, task=False)
        if record.status.terminal:
            return FinishOutcome(job_id, recorded=False, batch_id=record.batch_id)
        if trajectory is None:
            trajectory = self.stored_trajectory(job_id) or self.skeleton(record)
        trajectory.status = status
        trajectory.error = error
        now = time.time()
        trajectory.finished_at = now
        record.times["end"] = now
        trajectory.timing = self.timing(record, trajectory.timing)
        trajectory.hosts = record.hosts
        reward = "" if trajectory.reward is None else repr(float(trajectory.reward))
        batch = record.batch_id
        result = self._sync(
            self._finish,
            [
                self._job(job_id),
                self._traj(job_id),
                self._counts,
                self._done,
                self._batch(batch) if batch else "",
                self._batch_stream(batch) if batch else "",
                self._group(record.group_id),
                self._wake(job_id),
                self._turns(job_id),
                self._sums(job_id),
            ],
            [status.value, now],
            job_id,
            trajectory,
            tail=[
                reward,
                self.ttl,
                TERMINAL,
                error.model_dump_json() if error else "",
                self.p,
            ],
        )
        if int(result[0]) == -1:
            raise JobNotFound(job_id)
        recorded = int(result[0]) == 1
        if recorded:
            self.offload(job_id, trajectory, now)
        return FinishOutcome(
            job_id,
            recorded=recorded,
            batch_id=batch,
            event=text(result[1]) if recorded and len(result) > 1 else "",
            new_jobs=[text(x) for x in result[2:]] if recorded else [],
        )

    def wait(self, job_id: str, timeout: float) -> JobStatus:
        """Block until the job has finished or `timeout` seconds passed; returns its status."""
        deadline = time.monotonic() + timeout
        status = self.status(job_id)
        while not status.terminal:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Short blocks keep each call under the client's socket timeout.
            woke = self.r.blpop([self._wake(job_id)], timeout=min(left, 1.0))
            if woke is not None:
                # Put the token back so every other waiter on this job wakes too.
                self.r.lpush(self._wake(job_id), woke[1])
            status = self.status(job_id)
        return status
