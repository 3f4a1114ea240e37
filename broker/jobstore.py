"""The job store in Redis: job records, state transitions, trajectories, group and batch counters.

Every write that decides a job's fate is one Lua script, so a stage that runs twice (after a
redelivery) or a cancel racing a finishing worker cannot record a job twice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from api.schemas import (
    STAGES,
    TERMINAL_STATUSES,
    BatchProgress,
    JobStatus,
    StageError,
    Timing,
    Trajectory,
)

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
_TERMINAL = ",".join(sorted(s.value for s in TERMINAL_STATUSES))

# KEYS[1]=job hash KEYS[2]=status counts; ARGV: new status, now, terminal list, host
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'host_' .. ARGV[1], ARGV[4]) end
if cur == ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
redis.call('HSETNX', KEYS[1], 't_' .. ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], cur, -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
"""

# KEYS[1]=job hash KEYS[2]=trajectory; ARGV: trajectory json, ttl, terminal list
_SAVE_PARTIAL = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""

# KEYS: 1 job, 2 trajectory, 3 counts, 4 done zset, 5 batch hash, 6 batch stream, 7 group hash,
#       8 the job's wake-up list (waiters block on it)
# ARGV: 1 status, 2 now, 3 trajectory json, 4 reward ('' if none), 5 ttl, 6 terminal list,
#       7 error json
_FINISH = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[6] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
local ttl = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'status', ARGV[1], 't_end', ARGV[2], 'error', ARGV[7])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ttl)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HINCRBY', KEYS[3], cur, -1)
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
local job_id = redis.call('HGET', KEYS[1], 'job_id')
redis.call('ZADD', KEYS[4], ARGV[2], job_id)
redis.call('RPUSH', KEYS[8], ARGV[1])
redis.call('EXPIRE', KEYS[8], 600)
if KEYS[5] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HINCRBY', KEYS[5], 'n_' .. ARGV[1], 1)
  redis.call('HINCRBY', KEYS[5], 'finished', 1)
  if ARGV[4] ~= '' then
    redis.call('HINCRBYFLOAT', KEYS[5], 'reward_sum', ARGV[4])
    redis.call('HINCRBY', KEYS[5], 'reward_n', 1)
  end
  redis.call('XADD', KEYS[6], '*', 'job_id', job_id)
  local finished = redis.call('HINCRBY', KEYS[7], 'finished', 1)
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[7], 'r:' .. job_id, ARGV[4]) end
  if finished == tonumber(redis.call('HGET', KEYS[7], 'size')) then
    redis.call('HINCRBY', KEYS[5], 'groups_finished', 1)
  end
end
return 1
"""


class JobNotFound(KeyError):
    """No job (or batch) with that id is known."""


@dataclass
class JobSpec:
    """What the gateway decided for one job before it is enqueued."""

    task: dict[str, Any]
    data_source: str
    instance_id: str
    sampling: dict[str, Any]
    agent: dict[str, Any]
    group_id: str
    sample_index: int = 0
    batch_id: str | None = None
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    task_ids: dict[str, str] = field(
        default_factory=lambda: {stage: uuid.uuid4().hex for stage in STAGES}
    )


@dataclass
class JobRecord:
    """A job as the store holds it."""

    job_id: str
    status: JobStatus
    task: dict[str, Any]
    data_source: str
    instance_id: str
    group_id: str
    sample_index: int
    batch_id: str | None
    sampling: dict[str, Any]
    agent: dict[str, Any]
    task_ids: dict[str, str]
    created_at: float
    times: dict[str, float]
    durations: dict[str, float]
    backend_id: str | None
    policy_version: int | None
    error: StageError | None
    context: dict[str, Any] | None
    sandbox: dict[str, Any] | None
    """Where the job's sandbox lives (its keeper, socket and host), once INIT started it."""
    hosts: dict[str, str]
    """The node that ran each stage (the last one, if a stage ran twice)."""


class JobStore:
    """Job records in Redis under `prefix`; all methods are synchronous and safe to call twice."""

    def __init__(self, client: redis.Redis, prefix: str = "rs:", ttl: int = 7 * 86400) -> None:
        self.r = client
        self.p = prefix
        self.ttl = ttl
        self._transition = client.register_script(_TRANSITION)
        self._save_partial = client.register_script(_SAVE_PARTIAL)
        self._finish = client.register_script(_FINISH)

    # ------------------------------------------------------------------ keys
    def _job(self, job_id: str) -> str:
        return f"{self.p}job:{job_id}"

    def _traj(self, job_id: str) -> str:
        return f"{self.p}traj:{job_id}"

    def _batch(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}"

    def _batch_stream(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}:done"

    def _batch_jobs(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}:jobs"

    def _wake(self, job_id: str) -> str:
        return f"{self.p}wake:{job_id}"

    def _group(self, group_id: str) -> str:
        return f"{self.p}group:{group_id}"

    @property
    def _counts(self) -> str:
        return f"{self.p}counts"

    @property
    def _done(self) -> str:
        return f"{self.p}done"

    def _hist(self, stage: str) -> str:
        return f"{self.p}hist:{stage}"

    # ------------------------------------------------------------------ creation
    def create_jobs(
        self,
        specs: Sequence[JobSpec],
        *,
        batch_id: str | None = None,
        group_size: int = 1,
    ) -> None:
        """Write all job records (and the batch's) in one transaction, status `queued`."""
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        groups: dict[str, int] = {}
        for spec in specs:
            groups[spec.group_id] = groups.get(spec.group_id, 0) + 1
            pipe.hset(
                self._job(spec.job_id),
                mapping={
                    "job_id": spec.job_id,
                    "status": JobStatus.queued.value,
                    "task": json.dumps(spec.task),
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
        pipe.hincrby(self._counts, JobStatus.queued.value, len(specs))
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
            for key in (self._batch(batch_id), self._batch_jobs(batch_id)):
                pipe.expire(key, self.ttl)
            for group_id, size in groups.items():
                pipe.hset(self._group(group_id), mapping={"size": size, "finished": 0})
                pipe.expire(self._group(group_id), self.ttl)
        pipe.execute()

    def delete_jobs(self, specs: Iterable[JobSpec], batch_id: str | None = None) -> None:
        """Undo `create_jobs` when enqueueing failed, so nothing half-made is left behind."""
        specs = list(specs)
        pipe = self.r.pipeline(transaction=True)
        for spec in specs:
            pipe.delete(self._job(spec.job_id))
        pipe.hincrby(self._counts, JobStatus.queued.value, -len(specs))
        if batch_id is not None:
            pipe.delete(self._batch(batch_id), self._batch_jobs(batch_id))
            for group_id in {s.group_id for s in specs}:
                pipe.delete(self._group(group_id))
        pipe.execute()

    # ------------------------------------------------------------------ reads
    def get(self, job_id: str) -> JobRecord:
        raw = self.r.hgetall(self._job(job_id))
        if not raw:
            raise JobNotFound(job_id)
        h = {_s(k): _s(v) for k, v in raw.items()}
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
        )

    def status(self, job_id: str) -> JobStatus:
        raw = self.r.hget(self._job(job_id), "status")
        if raw is None:
            raise JobNotFound(job_id)
        return JobStatus(_s(raw))

    def trajectory(self, job_id: str) -> Trajectory:
        """The stored trajectory (final, or partial so far), or a skeleton from the record."""
        raw = self.r.get(self._traj(job_id))
        record = self.get(job_id)
        traj = Trajectory.model_validate_json(raw) if raw else self.skeleton(record)
        # The record is authoritative for status, error and timing; the trajectory may lag it.
        traj.status = record.status
        if record.error is not None:
            traj.error = record.error
        traj.timing = self.timing(record, traj.timing)
        traj.finished_at = record.times.get("end")
        traj.hosts = record.hosts
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
            args=[status.value, time.time(), _TERMINAL, host],
        )
        if result == -1:
            raise JobNotFound(job_id)
        return bool(result == 1)

    def set_fields(self, job_id: str, **fields: Any) -> None:
        """Record side facts of a live job (backend, policy version, context)."""
        mapping: dict[str | bytes, str | int | float] = {
            k: json.dumps(v) if isinstance(v, dict | list) else ("" if v is None else v)
            for k, v in fields.items()
        }
        self.r.hset(self._job(job_id), mapping=mapping)

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

    def save_partial(self, job_id: str, trajectory: Trajectory) -> bool:
        """Store the trajectory so far, unless the job has finished meanwhile."""
        result = self._save_partial(
            keys=[self._job(job_id), self._traj(job_id)],
            args=[trajectory.model_dump_json(), self.ttl, _TERMINAL],
        )
        return bool(result == 1)

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        trajectory: Trajectory | None = None,
        error: StageError | None = None,
    ) -> bool:
        """Record the job's end exactly once. Returns False when it had already ended.

        Without a trajectory, the partial one stored so far (or an empty one) is kept.
        """
        if not status.terminal:
            raise ValueError(f"{status} is not a final status")
        record = self.get(job_id)
        if record.status.terminal:
            return False
        if trajectory is None:
            raw = self.r.get(self._traj(job_id))
            trajectory = Trajectory.model_validate_json(raw) if raw else self.skeleton(record)
        trajectory.status = status
        trajectory.error = error
        now = time.time()
        trajectory.finished_at = now
        record.times["end"] = now
        trajectory.timing = self.timing(record, trajectory.timing)
        reward = "" if trajectory.reward is None else repr(float(trajectory.reward))
        batch = record.batch_id
        result = self._finish(
            keys=[
                self._job(job_id),
                self._traj(job_id),
                self._counts,
                self._done,
                self._batch(batch) if batch else "",
                self._batch_stream(batch) if batch else "",
                self._group(record.group_id),
                self._wake(job_id),
            ],
            args=[
                status.value,
                now,
                trajectory.model_dump_json(),
                reward,
                self.ttl,
                _TERMINAL,
                error.model_dump_json() if error else "",
            ],
        )
        return bool(result == 1)

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

    # ------------------------------------------------------------------ batches
    def batch_exists(self, batch_id: str) -> bool:
        return bool(self.r.exists(self._batch(batch_id)))

    def batch_job_ids(self, batch_id: str) -> list[str]:
        if not self.batch_exists(batch_id):
            raise JobNotFound(batch_id)
        return [_s(x) for x in self.r.lrange(self._batch_jobs(batch_id), 0, -1)]

    def batch_progress(self, batch_id: str) -> BatchProgress:
        raw = self.r.hgetall(self._batch(batch_id))
        if not raw:
            raise JobNotFound(batch_id)
        h = {_s(k): _s(v) for k, v in raw.items()}
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
            done=finished >= total,
            created_at=float(h["created_at"]),
        )

    def iter_finished(
        self, batch_id: str, block_ms: int = 1000, idle: Iterator[None] | None = None
    ) -> Iterator[str | None]:
        """Job ids of the batch as they finish (in finishing order), until all have.

        Yields None after each `block_ms` without news, so a streaming caller can send a
        keep-alive or notice that its client went away.
        """
        total = self.batch_progress(batch_id).total
        seen = 0
        last = "0-0"
        stream = self._batch_stream(batch_id)
        while seen < total:
            answer = self.r.xread({stream: last}, block=block_ms, count=500)
            if not answer:
                yield None
                continue
            for entry_id, fields in answer[0][1]:
                last = _s(entry_id)
                seen += 1
                yield _s(fields[b"job_id"] if b"job_id" in fields else fields["job_id"])

    # ------------------------------------------------------------------ metrics
    def status_counts(self) -> dict[str, int]:
        raw = self.r.hgetall(self._counts)
        counts = {s.value: 0 for s in JobStatus}
        counts.update({_s(k): int(v) for k, v in raw.items()})
        return counts

    def finished_since(self, since: float) -> int:
        self.r.zremrangebyscore(self._done, "-inf", time.time() - 3600)
        return int(self.r.zcount(self._done, since, "+inf"))

    def stage_histogram(self, stage: str) -> tuple[list[tuple[float, int]], int, float]:
        """Cumulative (bound, count) buckets, total count and sum of seconds for `stage`."""
        raw = {_s(k): _s(v) for k, v in self.r.hgetall(self._hist(stage)).items()}
        buckets = [(b, int(raw.get(f"le:{b}", 0))) for b in STAGE_BUCKETS]
        return buckets, int(raw.get("count", 0)), float(raw.get("sum", 0.0))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
