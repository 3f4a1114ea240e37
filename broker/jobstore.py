"""The job store in Redis: job records, state transitions, trajectories, group and batch counters.

Every write that decides a job's fate is one Lua script, so a stage that runs twice (after a
redelivery) or a cancel racing a finishing worker cannot record a job twice.

Dynamic-sampling (DAPO) batches keep their whole bookkeeping in the same scripts: the script
that records a job's end also decides, when it was the last job of its group, the group's
verdict (accepted, filtered, failed, cancelled, surplus), draws and creates the next groups
from the batch's task pool, and flips the batch to `cancelling` when its target is met — all
atomically, so concurrent workers never overdraw or cancel twice. Keys (`{p}` is the prefix):

- `{p}batch:{b}` hash: the plain batch counters, and for a dynamic batch `dynamic`=1, `state`
  (`running` → `draining` | `cancelling` → `done`), `target`, `inflight_max`, `attempts_max`,
  `early_cancel`, `pool_size`, `groups_seq|drawn|inflight|accepted|filtered|failed|cancelled|
  surplus`, `rollouts_*` and `seconds_*` (`used`, `filtered`, `wasted`), `t_target`, `t_done`;
- `{p}batch:{b}:spec` hash: `task:{i}`, `ds:{i}`, `iid:{i}` per pool task, `agent`, and
  `sampling:{a}` per attempt (attempt a of a task samples with seeds `seed + a*G + i`);
- `{p}batch:{b}:draws` list: pool indexes still to draw (a set-aside task is pushed back while
  it has attempts left); `{p}batch:{b}:attempts` hash: draws per pool index;
- `{p}batch:{b}:accepted` stream: job ids of accepted groups, then one `end` entry when the
  batch is done; `{p}batch:{b}:groups` list: accepted group ids in order;
- `{p}batch:{b}:unsent` sorted set: drawn jobs whose Celery chain is not yet sent (by time);
- `{p}batch:{b}:stopping` set (any batch): cancelled jobs not yet confirmed stopped — a stage
  of theirs still running (`active` in the job hash) or a sandbox not yet released — plus one
  token per cancellation pass in progress. A cancelling batch is done when it empties.

Dynamic jobs are created inside the scripts with ids `{b}-{seq}-{i}` (group `{b}-{seq}`); the
scripts compute keys from the prefix, so the store needs one Redis server (not a Cluster).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from core.schemas import (
    STAGES,
    TERMINAL_STATUSES,
    BatchProgress,
    DynamicProgress,
    JobStatus,
    StageError,
    Timing,
    Trajectory,
)

log = logging.getLogger(__name__)

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

# Lua helpers of the batch bookkeeping; every script that uses them starts with this text.
# `p` is the key prefix, `bid` a batch id, `now` the caller's clock (seconds, as text).
_LIB = """
local function nonempty(v) return v ~= nil and v ~= false and v ~= '' end

-- Give `key` the batch's remaining time to live.
local function keep(p, bid, key)
  local t = redis.call('TTL', p .. 'batch:' .. bid)
  if t > 0 then redis.call('EXPIRE', key, t) end
end

-- A cancelling batch whose stopping set has emptied is done; returns 'done' if it became so.
local function settle(p, bid, now)
  local bkey = p .. 'batch:' .. bid
  if redis.call('SCARD', bkey .. ':stopping') > 0 then return '' end
  if redis.call('HGET', bkey, 'state') ~= 'cancelling' then return '' end
  redis.call('HSET', bkey, 'state', 'done', 't_done', now)
  redis.call('XADD', bkey .. ':accepted', '*', 'end', '1')
  keep(p, bid, bkey .. ':accepted')
  return 'done'
end

-- A cancelled job is confirmed stopped once no stage of it runs and its sandbox is released.
local function ack(p, jkey, now)
  local h = redis.call('HMGET', jkey, 'job_id', 'batch_id', 'active', 'sandbox',
                       'sandbox_released')
  if not nonempty(h[2]) then return '' end
  local skey = p .. 'batch:' .. h[2] .. ':stopping'
  if redis.call('SISMEMBER', skey, h[1]) == 0 then return '' end
  if nonempty(h[3]) then return '' end
  if nonempty(h[4]) and h[5] ~= '1' then return '' end
  redis.call('SREM', skey, h[1])
  return settle(p, h[2], now)
end

-- Draw groups from the pool while fewer than `inflight_max` are in flight, creating their
-- jobs (status queued); returns the new job ids.
local function draw(p, bid, now)
  local bkey = p .. 'batch:' .. bid
  local b = redis.call('HMGET', bkey, 'state', 'inflight_max', 'group_size', 'tenant')
  local out = {}
  if b[1] ~= 'running' then return out end
  local tenant = b[4] or ''
  local live = p .. 'tenant:' .. tenant .. ':live'
  local cap, size = tonumber(b[2]), tonumber(b[3])
  local ttl = redis.call('TTL', bkey)
  while tonumber(redis.call('HGET', bkey, 'groups_inflight')) < cap do
    local idx = redis.call('LPOP', bkey .. ':draws')
    if not idx then break end
    local attempt = redis.call('HINCRBY', bkey .. ':attempts', idx, 1)
    local gid = bid .. '-' .. redis.call('HINCRBY', bkey, 'groups_seq', 1)
    -- spec[1] is a placeholder: the task itself stays in the spec hash (one copy per pool
    -- task, however many jobs sample it); jobs refer to it by key and field.
    local spec = redis.call('HMGET', bkey .. ':spec', 'ds:' .. idx, 'ds:' .. idx,
                            'iid:' .. idx, 'sampling:' .. (attempt - 1), 'agent')
    local ids = {}
    for i = 0, size - 1 do
      local jid = gid .. '-' .. i
      local jkey = p .. 'job:' .. jid
      local tids = '{"init": "' .. jid .. '-init", "run": "' .. jid .. '-run", "eval": "'
                   .. jid .. '-eval"}'
      redis.call('HSET', jkey, 'job_id', jid, 'status', 'queued',
                 'task_key', bkey .. ':spec', 'task_field', 'task:' .. idx, 'tenant', tenant,
                 'data_source', spec[2], 'instance_id', spec[3], 'group_id', gid,
                 'sample_index', i, 'batch_id', bid, 'sampling', spec[4], 'agent', spec[5],
                 'task_ids', tids, 'created_at', now, 't_queued', now)
      if ttl > 0 then redis.call('EXPIRE', jkey, ttl) end
      redis.call('ZADD', bkey .. ':unsent', now, jid)
      ids[#ids + 1] = jid
      out[#out + 1] = jid
    end
    redis.call('RPUSH', bkey .. ':jobs', unpack(ids))
    keep(p, bid, bkey .. ':jobs')
    if tenant ~= '' then
      redis.call('SADD', live, unpack(ids))
      if ttl > 0 then redis.call('EXPIRE', live, ttl) end
    end
    keep(p, bid, bkey .. ':attempts')
    local gkey = p .. 'group:' .. gid
    redis.call('HSET', gkey, 'size', size, 'finished', 0, 'task', idx, 'attempt', attempt,
               'jobs', table.concat(ids, ' '))
    if ttl > 0 then redis.call('EXPIRE', gkey, ttl) end
    redis.call('HINCRBY', p .. 'counts', 'queued', size)
    redis.call('HINCRBY', bkey, 'total', size)
    redis.call('HINCRBY', bkey, 'groups_total', 1)
    redis.call('HINCRBY', bkey, 'groups_drawn', 1)
    redis.call('HINCRBY', bkey, 'groups_inflight', 1)
  end
  keep(p, bid, bkey .. ':unsent')
  return out
end

-- The last job of a dynamic group has ended: judge the group, refill, detect the target.
-- Returns {1, event, new job ids...}; event is 'target' (the caller cancels the rest),
-- 'done' (the batch ended without needing a cancellation) or ''.
local function group_done(p, bid, gid, now)
  local bkey = p .. 'batch:' .. bid
  local gkey = p .. 'group:' .. gid
  local b = redis.call('HMGET', bkey, 'state', 'target', 'early_cancel', 'attempts_max')
  local state = b[1]
  local g = redis.call('HMGET', gkey, 'n_cancelled', 'n_unrewarded', 'rmin', 'rmax', 'secs',
                       'started', 'task', 'jobs')
  local verdict
  if tonumber(g[1] or '0') > 0 then verdict = 'cancelled'
  elseif state ~= 'running' then verdict = 'surplus'
  elseif tonumber(g[2] or '0') > 0 then verdict = 'failed'
  elseif tonumber(g[3]) == tonumber(g[4]) then verdict = 'filtered'
  else verdict = 'accepted' end
  redis.call('HSET', gkey, 'verdict', verdict)
  redis.call('HINCRBY', bkey, 'groups_inflight', -1)
  local count = redis.call('HINCRBY', bkey, 'groups_' .. verdict, 1)
  local secs, started = g[5] or '0', g[6] or '0'
  local out = {1, ''}
  if verdict == 'accepted' then
    redis.call('HINCRBYFLOAT', bkey, 'seconds_used', secs)
    redis.call('HINCRBY', bkey, 'rollouts_used', started)
    redis.call('RPUSH', bkey .. ':groups', gid)
    keep(p, bid, bkey .. ':groups')
    for jid in string.gmatch(g[8], '%S+') do
      redis.call('XADD', bkey .. ':accepted', '*', 'job_id', jid)
    end
    keep(p, bid, bkey .. ':accepted')
    if count >= tonumber(b[2]) then
      redis.call('HSET', bkey, 't_target', now)
      if b[3] == '1' then
        state = 'cancelling'
        redis.call('SADD', bkey .. ':stopping', '~target')
        keep(p, bid, bkey .. ':stopping')
        out[2] = 'target'
      else
        state = 'draining'
      end
      redis.call('HSET', bkey, 'state', state)
    end
  elseif verdict == 'filtered' or verdict == 'failed' then
    redis.call('HINCRBYFLOAT', bkey, 'seconds_filtered', secs)
    redis.call('HINCRBY', bkey, 'rollouts_filtered', started)
  else
    redis.call('HINCRBYFLOAT', bkey, 'seconds_wasted', secs)
    redis.call('HINCRBY', bkey, 'rollouts_wasted', started)
  end
  if state == 'running' and verdict ~= 'accepted' then
    local tried = redis.call('HGET', bkey .. ':attempts', g[7])
    if tonumber(tried or '0') < tonumber(b[4]) then
      redis.call('RPUSH', bkey .. ':draws', g[7])
    end
  end
  if state == 'running' then
    for _, jid in ipairs(draw(p, bid, now)) do out[#out + 1] = jid end
  end
  if (state == 'running' or state == 'draining')
     and tonumber(redis.call('HGET', bkey, 'groups_inflight')) == 0 then
    redis.call('HSET', bkey, 'state', 'done', 't_done', now)
    redis.call('XADD', bkey .. ':accepted', '*', 'end', '1')
    keep(p, bid, bkey .. ':accepted')
    out[2] = 'done'
  end
  return out
end
"""

# KEYS: 1 job, 2 trajectory, 3 counts, 4 done zset, 5 batch hash, 6 batch stream, 7 group hash,
#       8 the job's wake-up list (waiters block on it)
# ARGV: 1 status, 2 now, 3 trajectory json, 4 reward ('' if none), 5 ttl, 6 terminal list,
#       7 error json, 8 key prefix
# Returns {-1} (no such job), {0} (already ended) or {1, event, new job ids...} (see
# group_done; event '' and no ids for a job outside dynamic batches).
_FINISH = (
    _LIB
    + """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {-1} end
if string.find(',' .. ARGV[6] .. ',', ',' .. cur .. ',', 1, true) then return {0} end
local ttl = tonumber(ARGV[5])
local p, now = ARGV[8], ARGV[2]
local held = redis.call('HMGET', KEYS[1], 'active', 'sandbox', 'sandbox_released', 't_init',
                        'tenant')
redis.call('HSET', KEYS[1], 'status', ARGV[1], 't_end', now, 'error', ARGV[7])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ttl)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HINCRBY', KEYS[3], cur, -1)
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
local job_id = redis.call('HGET', KEYS[1], 'job_id')
if nonempty(held[5]) then redis.call('SREM', p .. 'tenant:' .. held[5] .. ':live', job_id) end
redis.call('ZADD', KEYS[4], now, job_id)
redis.call('RPUSH', KEYS[8], ARGV[1])
redis.call('EXPIRE', KEYS[8], 600)
local out = {1, ''}
if KEYS[5] ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then
  local bid = redis.call('HGET', KEYS[5], 'batch_id')
  if ARGV[1] == 'cancelled' and
     (nonempty(held[1]) or (nonempty(held[2]) and held[3] ~= '1')) then
    -- a stage of it still runs, or its sandbox is up: done only once that has stopped
    redis.call('SADD', KEYS[5] .. ':stopping', job_id)
    keep(p, bid, KEYS[5] .. ':stopping')
  end
  redis.call('HINCRBY', KEYS[5], 'n_' .. ARGV[1], 1)
  redis.call('HINCRBY', KEYS[5], 'finished', 1)
  if ARGV[4] ~= '' then
    redis.call('HINCRBYFLOAT', KEYS[5], 'reward_sum', ARGV[4])
    redis.call('HINCRBY', KEYS[5], 'reward_n', 1)
  end
  redis.call('XADD', KEYS[6], '*', 'job_id', job_id)
  local finished = redis.call('HINCRBY', KEYS[7], 'finished', 1)
  if redis.call('TTL', KEYS[7]) < ttl then redis.call('EXPIRE', KEYS[7], ttl) end
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[7], 'r:' .. job_id, ARGV[4]) end
  local dynamic = redis.call('HGET', KEYS[5], 'dynamic') == '1'
  if dynamic then
    -- rollout-seconds: from the job's first stage to its end (0 if it never started)
    if nonempty(held[4]) then
      redis.call('HINCRBYFLOAT', KEYS[7], 'secs', math.max(0, tonumber(now) - tonumber(held[4])))
      redis.call('HINCRBY', KEYS[7], 'started', 1)
    end
    if ARGV[1] == 'cancelled' then
      redis.call('HINCRBY', KEYS[7], 'n_cancelled', 1)
    elseif ARGV[4] == '' then
      redis.call('HINCRBY', KEYS[7], 'n_unrewarded', 1)
    else
      local r = tonumber(ARGV[4])
      local lo = redis.call('HGET', KEYS[7], 'rmin')
      local hi = redis.call('HGET', KEYS[7], 'rmax')
      if not lo or r < tonumber(lo) then redis.call('HSET', KEYS[7], 'rmin', ARGV[4]) end
      if not hi or r > tonumber(hi) then redis.call('HSET', KEYS[7], 'rmax', ARGV[4]) end
    end
  end
  if finished == tonumber(redis.call('HGET', KEYS[7], 'size')) then
    redis.call('HINCRBY', KEYS[5], 'groups_finished', 1)
    if dynamic then
      out = group_done(p, bid, redis.call('HGET', KEYS[1], 'group_id'), now)
    end
  end
end
return out
"""
)

# ARGV: 1 prefix, 2 batch id, 3 now. The gateway's first draw of a new dynamic batch.
_DRAW = (
    _LIB
    + """
return draw(ARGV[1], ARGV[2], ARGV[3])
"""
)

# KEYS[1]=job hash; ARGV: 1 task id, 2 where (host|pid|start time), 3 terminal list.
# A stage may begin only while its job is live; returns -1 (no job), 0 (ended) or 1.
_STAGE_BEGIN = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'active', ARGV[1], 'active_at', ARGV[2])
return 1
"""

# KEYS[1]=job hash; ARGV: 1 prefix, 2 task id ('' for none), 3 now, 4 '1' to mark the sandbox
# released. Clears the stage mark (if it is this task's) and confirms a cancelled job stopped.
_STAGE_END = (
    _LIB
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'sandbox_released', '1') end
local active = redis.call('HGET', KEYS[1], 'active')
if ARGV[2] ~= '' and active == ARGV[2] then
  redis.call('HDEL', KEYS[1], 'active', 'active_at')
end
return ack(ARGV[1], KEYS[1], ARGV[3])
"""
)

# ARGV: 1 prefix, 2 batch id, 3 token, 4 now. A cancellation pass joins the batch: a dynamic
# batch stops drawing (state cancelling) and is not done before the pass ends (its token
# leaves the stopping set). Returns 0 when the batch is over already, else 1.
_CANCEL_BEGIN = (
    _LIB
    + """
local bkey = ARGV[1] .. 'batch:' .. ARGV[2]
if redis.call('EXISTS', bkey) == 0 then return -1 end
local state = redis.call('HGET', bkey, 'state')
if state == 'done' then return 0 end
if state == 'running' or state == 'draining' then
  redis.call('HSET', bkey, 'state', 'cancelling')
  redis.call('HSETNX', bkey, 't_cancel', ARGV[4])
end
redis.call('SADD', bkey .. ':stopping', ARGV[3])
keep(ARGV[1], ARGV[2], bkey .. ':stopping')
return 1
"""
)

# ARGV: 1 prefix, 2 batch id, 3 token, 4 now. A cancellation pass has ended.
_CANCEL_END = (
    _LIB
    + """
redis.call('SREM', ARGV[1] .. 'batch:' .. ARGV[2] .. ':stopping', ARGV[3])
return settle(ARGV[1], ARGV[2], ARGV[4])
"""
)

# KEYS[1]=unsent zset; ARGV: 1 cutoff, 2 now. Claims the entries older than the cutoff (their
# sender is presumed gone) by moving them to now; returns them.
_CLAIM_UNSENT = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, jid in ipairs(stale) do redis.call('ZADD', KEYS[1], ARGV[2], jid) end
return stale
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
    task_ids: dict[str, str] = field(default_factory=dict)
    """Celery task id per stage; `{job_id}-{stage}` unless given (a revoked task's job is then
    known from its id alone)."""

    def __post_init__(self) -> None:
        if not self.task_ids:
            self.task_ids = stage_task_ids(self.job_id)


def stage_task_ids(job_id: str) -> dict[str, str]:
    """The Celery task ids of a job's stages."""
    return {stage: f"{job_id}-{stage}" for stage in STAGES}


def job_of_task(task_id: str) -> str | None:
    """The job id in a stage task id made by `stage_task_ids`, or None."""
    job_id, _, stage = task_id.rpartition("-")
    return job_id if job_id and stage in STAGES else None


@dataclass
class FinishOutcome:
    """What recording one job's end set in motion (see the module docstring)."""

    job_id: str
    recorded: bool
    """False when the job had ended already (nothing changed)."""
    batch_id: str | None = None
    event: str = ""
    """`target`: this end completed the group that met a dynamic batch's target, and the
    caller must cancel the rest of the batch; `done`: the batch ended without that."""
    new_jobs: list[str] = field(default_factory=list)
    """Jobs of groups drawn to refill the batch: created, not yet sent to Celery."""


@dataclass
class PoolTask:
    """One task of a dynamic batch's pool, as the gateway validated it."""

    task: dict[str, Any]
    data_source: str
    instance_id: str


@dataclass
class DynamicOptions:
    """Resolved dynamic-sampling options of a batch."""

    target_groups: int
    group_size: int
    max_inflight_groups: int
    max_attempts_per_task: int
    early_cancel: bool = True


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
        self._draw = client.register_script(_DRAW)
        self._stage_begin = client.register_script(_STAGE_BEGIN)
        self._stage_end = client.register_script(_STAGE_END)
        self._cancel_begin = client.register_script(_CANCEL_BEGIN)
        self._cancel_end = client.register_script(_CANCEL_END)
        self._claim_unsent = client.register_script(_CLAIM_UNSENT)
        self.followup: Callable[[FinishOutcome], None] | None = None
        """Called after a job's end drew new jobs or met a batch's target (sends them, or
        cancels the rest); set by whoever holds a Celery app (workers, the gateway)."""

    # ------------------------------------------------------------------ keys
    def _job(self, job_id: str) -> str:
        return f"{self.p}job:{job_id}"

    def job_key(self, job_id: str) -> str:
        """The Redis hash of the job's record (its `status` field says where it is)."""
        return self._job(job_id)

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

    def _bkey(self, batch_id: str, part: str) -> str:
        return f"{self.p}batch:{batch_id}:{part}"

    @property
    def _counts(self) -> str:
        return f"{self.p}counts"

    @property
    def _done(self) -> str:
        return f"{self.p}done"

    def _hist(self, stage: str) -> str:
        return f"{self.p}hist:{stage}"

    def _tenant_live(self, tenant: str) -> str:
        return f"{self.p}tenant:{tenant}:live"

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
                group_tasks.setdefault(spec.group_id, json.dumps(spec.task))
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
        pipe.hincrby(self._counts, JobStatus.queued.value, -len(specs))
        if tenant and specs:
            pipe.srem(self._tenant_live(tenant), *[s.job_id for s in specs])
        if batch_id is not None:
            pipe.delete(self._batch(batch_id), self._batch_jobs(batch_id))
            for group_id in {s.group_id for s in specs}:
                pipe.delete(self._group(group_id))
        pipe.execute()

    # ------------------------------------------------------------------ dynamic batches
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
        for key in (bkey, self._bkey(batch_id, "spec"), self._bkey(batch_id, "draws")):
            pipe.expire(key, self.ttl)
        pipe.execute()
        return [_s(x) for x in self._draw(args=[self.p, batch_id, now])]

    def delete_batch(self, batch_id: str) -> None:
        """Undo `create_dynamic_batch` (its jobs are all still queued) when sending failed."""
        job_ids = [_s(x) for x in self.r.lrange(self._batch_jobs(batch_id), 0, -1)]
        groups = {job_id.rsplit("-", 1)[0] for job_id in job_ids}
        tenant = _s(self.r.hget(self._batch(batch_id), "tenant") or "")
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
        pipe.execute()

    def is_dynamic(self, batch_id: str) -> bool:
        return _s(self.r.hget(self._batch(batch_id), "dynamic") or "") == "1"

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
        return [_s(x) for x in claimed]

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
        return _s(self._cancel_end(args=[self.p, batch_id, token, time.time()])) == "done"

    def batch_done(self, batch_id: str) -> bool:
        """`batch_progress(batch_id).done`, in one cheap round trip."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(self._batch(batch_id), ["dynamic", "state", "finished", "total"])
        pipe.scard(self._bkey(batch_id, "stopping"))
        (dynamic, state, finished, total), stopping = pipe.execute()
        if total is None:
            raise JobNotFound(batch_id)
        if dynamic:
            return _s(state) == "done"
        return int(finished or 0) >= int(total) and not stopping

    def stopping(self, batch_id: str) -> set[str]:
        """Cancelled jobs of the batch not yet confirmed stopped, and passes in progress."""
        return {_s(x) for x in self.r.smembers(self._bkey(batch_id, "stopping"))}

    def batch_state(self, batch_id: str) -> dict[str, str]:
        """The batch's hash as text (empty if unknown)."""
        return {_s(k): _s(v) for k, v in self.r.hgetall(self._batch(batch_id)).items()}

    # ------------------------------------------------------------------ reads
    def get(self, job_id: str, *, task: bool = True) -> JobRecord:
        """The job's record; with `task=False` its `task` is left empty (one read less)."""
        raw = self.r.hgetall(self._job(job_id))
        if not raw:
            raise JobNotFound(job_id)
        h = {_s(k): _s(v) for k, v in raw.items()}
        if not task:
            h["task"] = "{}"
        elif "task" not in h:
            # stored once for the job's group (or a dynamic batch's pool); gone only when
            # the record has outlived it
            h["task"] = _s(self.r.hget(h.get("task_key", ""), h.get("task_field", "")) or "{}")
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
                if raw is not None and not JobStatus(_s(raw)).terminal:
                    live.append(job_id)
        return live

    def unfinished(self, tenant: str, recount: bool = False) -> int:
        """How many of the tenant's jobs have not ended. With `recount`, jobs whose record
        expired or was deleted without an end are dropped from the count first."""
        key = self._tenant_live(tenant)
        if recount:
            members = [_s(m) for m in self.r.sscan_iter(key, count=1000)]
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
        return JobStatus(_s(raw))

    def live(self, job_ids: Iterable[str]) -> set[str]:
        """Those of `job_ids` whose record exists and has not reached a final status (one
        round trip)."""
        ids = list(job_ids)
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self._job(job_id), "status")
        return {
            job_id
            for job_id, raw in zip(ids, pipe.execute(), strict=True)
            if raw is not None and not JobStatus(_s(raw)).terminal
        }

    def trajectory(self, job_id: str) -> Trajectory:
        """The stored trajectory (final, or partial so far), or a skeleton from the record."""
        raw = self.r.get(self._traj(job_id))
        record = self.get(job_id, task=False)
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
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._job(job_id), mapping=mapping)
        if "sandbox" in fields:  # a new box (e.g. a redelivered INIT's) is not released yet
            pipe.hdel(self._job(job_id), "sandbox_released")
        pipe.execute()

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

        Without a trajectory, the partial one stored so far (or an empty one) is kept. When
        the end drew new jobs for a dynamic batch or met its target, `followup` is called.
        """
        outcome = self.finish_outcome(job_id, status, trajectory, error)
        if self.followup is not None and (outcome.new_jobs or outcome.event == "target"):
            try:
                self.followup(outcome)
            except Exception:
                # The end is recorded; unsent jobs are sent again by `recover` later.
                log.exception("follow-up of job %s's end failed", job_id)
        return outcome.recorded

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
                self.p,
            ],
        )
        if int(result[0]) == -1:
            raise JobNotFound(job_id)
        return FinishOutcome(
            job_id,
            recorded=int(result[0]) == 1,
            batch_id=batch,
            event=_s(result[1]) if len(result) > 1 else "",
            new_jobs=[_s(x) for x in result[2:]],
        )

    # ------------------------------------------------------------------ stage marks
    def stage_begin(self, job_id: str, task_id: str, where: str = "") -> bool:
        """Mark a stage task of the job as running; False (and no mark) if the job has ended.

        With the mark, a cancel waits for `stage_end` before it counts the job as stopped;
        without it, a cancel and a starting stage cannot both go on (one Lua script each).
        `where` (host|pid|process start time) lets the worker wait for a killed process.
        """
        result = self._stage_begin(keys=[self._job(job_id)], args=[task_id, where, _TERMINAL])
        if result == -1:
            raise JobNotFound(job_id)
        return bool(result == 1)

    def stage_end(self, job_id: str, task_id: str = "", *, sandbox_released: bool = False) -> bool:
        """Clear the stage mark of `task_id` (if it is still that task's) and, with
        `sandbox_released`,
        record that the job's sandbox is gone; returns True if that made a cancelling batch
        done (every one of its cancelled jobs is confirmed stopped)."""
        result = self._stage_end(
            keys=[self._job(job_id)],
            args=[self.p, task_id, time.time(), "1" if sandbox_released else ""],
        )
        return _s(result) == "done"

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
        return {j: _s(t) for j, t in zip(job_ids, pipe.execute(), strict=True) if t}

    def active_stage(self, job_id: str) -> tuple[str, str] | None:
        """The running stage task of the job and where it runs (host|pid|start), or None."""
        task_id, where = self.r.hmget(self._job(job_id), ["active", "active_at"])
        return (_s(task_id), _s(where or "")) if task_id else None

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
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self._batch(batch_id))
        pipe.scard(self._bkey(batch_id, "stopping"))
        raw, stopping = pipe.execute()
        if not raw:
            raise JobNotFound(batch_id)
        h = {_s(k): _s(v) for k, v in raw.items()}
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

    def _dynamic_progress(self, batch_id: str, h: dict[str, str]) -> DynamicProgress:
        pipe = self.r.pipeline(transaction=False)
        pipe.lrange(self._bkey(batch_id, "groups"), 0, -1)
        pipe.hgetall(self._bkey(batch_id, "attempts"))
        pipe.smembers(self._bkey(batch_id, "stopping"))
        groups, attempts, members = pipe.execute()
        drawn = {int(_s(k)) for k, v in attempts.items() if int(v) > 0}
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
            unconfirmed_stops=sum(1 for m in members if not _s(m).startswith("~")),
            accepted_groups=[_s(g) for g in groups],
            tasks_never_drawn=[i for i in range(count("pool_size")) if i not in drawn],
        )

    def iter_finished(
        self, batch_id: str, block_ms: int = 1000, idle: Iterator[None] | None = None
    ) -> Iterator[str | None]:
        """Job ids of the batch as they finish (in finishing order), until all have.

        Yields None after each `block_ms` without news, so a streaming caller can send a
        keep-alive or notice that its client went away.
        """
        if self.is_dynamic(batch_id):
            yield from self._iter_accepted(batch_id, block_ms)
            return
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

    def _iter_accepted(self, batch_id: str, block_ms: int) -> Iterator[str | None]:
        """A dynamic batch's accepted jobs, group by group, until the batch is done."""
        last = "0-0"
        stream = self._bkey(batch_id, "accepted")
        while True:
            answer = self.r.xread({stream: last}, block=block_ms, count=500)
            if not answer:
                if not self.batch_exists(batch_id):
                    return  # expired or deleted under us
                yield None
                continue
            for entry_id, raw in answer[0][1]:
                last = _s(entry_id)
                fields = {_s(k): _s(v) for k, v in raw.items()}
                if "end" in fields:
                    return
                yield fields["job_id"]

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
