"""The registry of inference backends and the assignment of jobs to them.

Every backend that may take new work is a member of one Redis sorted set used as a min-heap.
Its score is its load after one more assignment, ``(jobs holding it + 1) / capacity``, so the
least-loaded backend by *current* load (weighted by capacity) is always at the top. A job
acquires the top backend and keeps it (sticky routing: its growing prompt keeps hitting the
same server's prefix cache) until it ends, or until that backend is drained or found dead: the
job's next request then moves to the least-loaded backend and simply prefills there.

A backend is assignable when it is healthy and not draining; only assignable backends are in
the heap. Draining is the operator's intent (weight updates: nothing new is assigned, running
requests finish, the backend is idle once no job holds it); health is the monitor's finding
(failed ``/health`` probes or a request lost with its server make it dead; a probe that
answers re-admits it).

Every change is one Lua script, so any number of workers and gateways can route at once and
every count stays exact. Counts cannot leak: the holders hash is the truth, and ``reconcile``
drops the holds of jobs that are no longer live and rebuilds every count from what is left.

Redis keys (``{p}`` is the prefix, ``rs:`` by default):

- ``{p}pool:heap`` — sorted set of assignable backends, score = (load + 1) / capacity;
- ``{p}pool:load`` — hash, backend id → jobs holding it;
- ``{p}pool:holders`` — hash, job id → ``"{backend_id}|{epoch}"`` while the job holds one;
- ``{p}pool:backend:{id}`` — hash: ``url``, ``kind``, ``api``, ``model``, ``capacity``,
  ``tokenizer``, ``policy_version``, ``max_model_len`` and ``api_key`` (empty when unset or
  unknown),
  ``registered_at``, ``draining``
  and ``healthy`` (``0``/``1``), ``failures`` (consecutive failed health checks);
- ``{p}pool:epoch`` — hash, backend id → registration epoch (changes when an id is removed
  and registered again, so a job that held the old registration never counts against the new);
- ``{p}pool:epoch-seq`` — the counter that epochs are drawn from.

The scripts name keys from the prefix they are given, so the pool needs one Redis (not a
cluster). This module depends on redis-py and the wire schemas only.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis

from core.schemas import Backend, BackendSpec

log = logging.getLogger(__name__)

DEFAULT_FAILURE_THRESHOLD = 3
"""Consecutive failed health checks after which a backend is taken out of rotation."""


class NoBackendError(RuntimeError):
    """No inference backend is registered, so a job cannot be assigned one."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "no inference backend is registered; POST /v1/backends "
            '{"url": "http://host:8000", "model": "..."} (or start the development '
            "server with `rollserve dev-backend`) and try again"
        )


class NoHealthyBackendError(NoBackendError):
    """Backends are registered but none takes work now (all draining or dead)."""


class JobEnded(Exception):
    """The job being routed has ended (or its record is gone): it gets no backend."""


class MalformedBackendError(ValueError):
    """A backend's record in Redis cannot be read as a backend (a field missing or of the
    wrong form)."""

    def __init__(self, backend_id: str, why: str) -> None:
        super().__init__(f"the record of backend {backend_id!r} is malformed: {why}")
        self.backend_id = backend_id


# Functions every script below starts with. KEYS are unused: ARGV[1] is the key prefix.
_PRELUDE = """
local p = ARGV[1]
local heap, loads, holders, epochs = p .. 'pool:heap', p .. 'pool:load', p .. 'pool:holders',
  p .. 'pool:epoch'
local function bkey(id) return p .. 'pool:backend:' .. id end
-- Put the backend in the heap (scored by its load after one more job) or take it out.
-- A record without a usable capacity is never assignable.
local function sync(id)
  local f = redis.call('HMGET', bkey(id), 'capacity', 'draining', 'healthy')
  local capacity = tonumber(f[1] or '')
  if not capacity or capacity <= 0 or not redis.call('HGET', epochs, id) then
    redis.call('ZREM', heap, id)
    return
  end
  if f[2] == '1' or f[3] == '0' then
    redis.call('ZREM', heap, id)
  else
    local load = tonumber(redis.call('HGET', loads, id) or '0')
    redis.call('ZADD', heap, (load + 1) / capacity, id)
  end
end
-- The backend a hold names, if that registration still exists.
local function held_id(held)
  if not held then return nil end
  local sep = string.find(held, '|', 1, true)
  if not sep then return nil end
  local id = string.sub(held, 1, sep - 1)
  if redis.call('HGET', epochs, id) ~= string.sub(held, sep + 1) then return nil end
  return id
end
local function unhold(job, id)
  redis.call('HDEL', holders, job)
  if id then
    local load = tonumber(redis.call('HGET', loads, id) or '0')
    if load > 0 then redis.call('HINCRBY', loads, id, -1) end
    sync(id)
  end
end
"""

# ARGV: prefix, id, url, kind, api, model, capacity, policy_version, now, tokenizer,
# max_model_len, api_key
# A new id (or one registered again after removal) starts healthy, not draining, with a
# fresh epoch and no load; registering an id again keeps its load, state and holders.
_REGISTER = (
    _PRELUDE
    + """
local id = ARGV[2]
local created = 0
if not redis.call('HGET', epochs, id) then
  redis.call('HSET', epochs, id, redis.call('INCR', p .. 'pool:epoch-seq'))
  redis.call('DEL', bkey(id))
  redis.call('HSET', bkey(id), 'registered_at', ARGV[9], 'draining', '0', 'healthy', '1',
             'failures', '0')
  redis.call('HSET', loads, id, 0)
  created = 1
end
redis.call('HSET', bkey(id), 'url', ARGV[3], 'kind', ARGV[4], 'api', ARGV[5], 'model', ARGV[6],
           'capacity', ARGV[7], 'policy_version', ARGV[8], 'tokenizer', ARGV[10],
           'max_model_len', ARGV[11], 'api_key', ARGV[12])
sync(id)
return created
"""
)

# ARGV: prefix, id. Holds on the old registration are ignored from now on (epoch gone).
_REMOVE = (
    _PRELUDE
    + """
local id = ARGV[2]
local existed = redis.call('HDEL', epochs, id)
redis.call('ZREM', heap, id)
redis.call('DEL', bkey(id))
redis.call('HDEL', loads, id)
return existed
"""
)

# ARGV: prefix, job, the job's record key ('' to skip the check), its final statuses
# (',a,b,'). Returns {backend id or '', the backend the job left or '', moved 0/1, the
# backend's policy version, its url, ended 0/1}. A job whose record says it has ended (or is
# gone) gives up its hold and gets no backend: one round trip checks and routes.
# A job whose backend is still assignable keeps it without counting again (a redelivered stage
# may route twice). One whose backend is draining, dead or removed gives it up and takes the
# least-loaded assignable one; ZRANGE orders equal scores by member, so ties break the same
# way every time. With nothing assignable the job keeps no hold and gets ''.
_ROUTE = (
    _PRELUDE
    + """
local job = ARGV[2]
local held = redis.call('HGET', holders, job)
local id = held_id(held)
local left = ''
if ARGV[3] ~= '' then
  local status = redis.call('HGET', ARGV[3], 'status')
  if not status or string.find(ARGV[4], ',' .. status .. ',', 1, true) then
    if held then unhold(job, id) end
    return {'', '', 0, '', '', 1}
  end
end
local function answer(chosen, left, moved)
  local f = redis.call('HMGET', bkey(chosen), 'policy_version', 'url')
  return {chosen, left, moved, f[1] or '', f[2] or '', 0}
end
if id and redis.call('ZSCORE', heap, id) then
  return answer(id, '', 0)
end
if held then
  unhold(job, id)
  left = id or ''
end
local pick = redis.call('ZRANGE', heap, 0, 0)
if #pick == 0 then
  return {'', left, 0, '', '', 0}
end
local new = pick[1]
redis.call('HINCRBY', loads, new, 1)
redis.call('HSET', holders, job, new .. '|' .. redis.call('HGET', epochs, new))
sync(new)
local moved = 0
if held then moved = 1 end
return answer(new, left, moved)
"""
)

# ARGV: prefix, job, only_if_unassignable ('1': keep a hold on a backend that still takes
# work, so the job stays sticky). The hold is deleted in the same script that decrements, so
# a second release finds nothing to do; a removed backend is left alone.
_RELEASE = (
    _PRELUDE
    + """
local job = ARGV[2]
local held = redis.call('HGET', holders, job)
if not held then return false end
local id = held_id(held)
if ARGV[3] == '1' and id and redis.call('ZSCORE', heap, id) then return false end
unhold(job, id)
return id or false
"""
)

# ARGV: prefix. The policy version of every registered backend that announced one (any
# state), for `current_version` to take the newest of (in Python: versions are 64-bit
# integers, and Lua's numbers are doubles).
_VERSIONS = """
local p, found = ARGV[1], {}
for _, id in ipairs(redis.call('HKEYS', p .. 'pool:epoch')) do
  local v = redis.call('HGET', p .. 'pool:backend:' .. id, 'policy_version')
  if v and v ~= '' then table.insert(found, v) end
end
return found
"""

# ARGV: prefix, id, field, value. Sets a state field and puts the backend in or out of the
# heap. Returns 0 for an unknown id.
_SET = (
    _PRELUDE
    + """
local id = ARGV[2]
if not redis.call('HGET', epochs, id) then return 0 end
redis.call('HSET', bkey(id), ARGV[3], ARGV[4])
if ARGV[3] == 'healthy' and ARGV[4] == '1' then redis.call('HSET', bkey(id), 'failures', 0) end
sync(id)
return 1
"""
)

# ARGV: prefix, id, start time. Records when the backend's engine started; returns
# {registered 0/1, the start time recorded before ('' for none)}.
_NOTE_STARTED = (
    _PRELUDE
    + """
local id = ARGV[2]
if not redis.call('HGET', epochs, id) then return {0, ''} end
local before = redis.call('HGET', bkey(id), 'started_at') or ''
redis.call('HSET', bkey(id), 'started_at', ARGV[3])
return {1, before}
"""
)

# ARGV: prefix, id, ok ('1'/'0'), threshold. A success clears the failures and re-admits; a
# failure counts, and the threshold-th in a row takes the backend out. Returns
# {registered 0/1, healthy before, healthy after}.
_HEALTH = (
    _PRELUDE
    + """
local id = ARGV[2]
if not redis.call('HGET', epochs, id) then return {0, 0, 0} end
local before = redis.call('HGET', bkey(id), 'healthy') == '1' and 1 or 0
local after = before
if ARGV[3] == '1' then
  redis.call('HSET', bkey(id), 'failures', 0, 'healthy', '1')
  after = 1
else
  local failures = redis.call('HINCRBY', bkey(id), 'failures', 1)
  if failures >= tonumber(ARGV[4]) then
    redis.call('HSET', bkey(id), 'healthy', '0')
    after = 0
  end
end
sync(id)
return {1, before, after}
"""
)

# ARGV: prefix, then the ids of jobs that are no longer live. Their holds go; every load is
# rebuilt from the holds that are left. Returns the number of loads that were wrong.
_RECONCILE = (
    _PRELUDE
    + """
for i = 2, #ARGV do redis.call('HDEL', holders, ARGV[i]) end
local counts = {}
local all = redis.call('HGETALL', holders)
for i = 1, #all, 2 do
  local id = held_id(all[i + 1])
  if id then
    counts[id] = (counts[id] or 0) + 1
  else
    redis.call('HDEL', holders, all[i])
  end
end
local fixed = 0
local registered = redis.call('HKEYS', epochs)
for _, id in ipairs(registered) do
  local want = counts[id] or 0
  if tonumber(redis.call('HGET', loads, id) or '-1') ~= want then
    fixed = fixed + 1
    redis.call('HSET', loads, id, want)
  end
  sync(id)
end
return fixed
"""
)

BackendScan = tuple[list[Backend], list[str]]
"""The readable backends, and the ids of those whose record is malformed."""

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def derive_backend_id(url: str) -> str:
    """A stable, readable id for a backend URL: ``http://gpu-3:8000`` → ``gpu-3-8000``.

    The port defaults to the scheme's; a path other than ``/`` is appended, so two servers
    behind one host get different ids.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "backend").strip("[]")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    raw = f"{host}-{port}"
    path = parts.path.strip("/")
    if path:
        raw = f"{raw}-{path}"
    ident = _ID_UNSAFE.sub("_", raw).strip("_") or "backend"
    return ident[:128]


def _text(value: Any) -> str:
    """A Redis reply as text, whether or not the client decodes responses."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


@dataclass(frozen=True)
class Route:
    """Where a job's next request goes."""

    backend_id: str
    left: str | None = None
    """The backend the job gave up (drained, dead or removed), if it moved."""
    policy_version: int | None = None
    """The backend's policy version now."""
    url: str = ""

    @property
    def moved(self) -> bool:
        return self.left is not None


class BackendPool:
    """Registered inference backends and which job holds which, kept in Redis.

    Safe to use from many threads and processes at once: every change that touches the
    counts is a single Lua script.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "rs:",
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.failure_threshold = max(1, int(failure_threshold))
        self.heap_key = f"{prefix}pool:heap"
        self.load_key = f"{prefix}pool:load"
        self.holders_key = f"{prefix}pool:holders"
        self.epoch_key = f"{prefix}pool:epoch"
        self._register = client.register_script(_REGISTER)
        self._remove = client.register_script(_REMOVE)
        self._route = client.register_script(_ROUTE)
        self._release = client.register_script(_RELEASE)
        self._set = client.register_script(_SET)
        self._note_started = client.register_script(_NOTE_STARTED)
        self._health = client.register_script(_HEALTH)
        self._reconcile = client.register_script(_RECONCILE)
        self._versions = client.register_script(_VERSIONS)

    def backend_key(self, backend_id: str) -> str:
        return f"{self.prefix}pool:backend:{backend_id}"

    # ------------------------------------------------------------------ registry

    def register(self, spec: BackendSpec, max_model_len: int | None = None) -> Backend:
        """Add a backend, or update one with the same id; returns it as now registered.

        The id is ``spec.id``, or derived from the URL. Registering an id again updates its
        URL, kind, API, model, capacity, policy version and context length (`max_model_len`,
        as the server reported it; None for unknown) and keeps its load, its state
        (draining, dead) and the jobs that hold it.
        """
        backend_id = spec.id or derive_backend_id(spec.url)
        self._register(
            args=[
                self.prefix,
                backend_id,
                spec.url,
                spec.kind,
                spec.api,
                spec.model,
                repr(float(spec.capacity)),
                "" if spec.policy_version is None else str(spec.policy_version),
                repr(time.time()),
                spec.tokenizer or "",
                "" if max_model_len is None else str(int(max_model_len)),
                spec.api_key or "",
            ],
        )
        backend = self.get(backend_id)
        if backend is None:  # removed by someone else in between
            raise KeyError(backend_id)
        return backend

    def current_version(self) -> int | None:
        """The newest policy version a registered backend holds (whatever its state), or None
        when none announced one: what `max_staleness` is measured from. A fleet switched back
        to an older version (a new training run from version 0) makes that one current."""
        versions = [int(_text(v)) for v in self._versions(args=[self.prefix])]
        return max(versions) if versions else None

    def remove(self, backend_id: str) -> bool:
        """Unregister a backend; False if it was not registered.

        Jobs that held it move to another backend on their next ``route``; their ``release``
        does nothing to the counts.
        """
        return bool(int(self._remove(args=[self.prefix, backend_id])))

    def get(self, backend_id: str) -> Backend | None:
        """The backend with this id, its load and state, or None.

        Raises MalformedBackendError when its record cannot be read."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.backend_key(backend_id))
        pipe.hget(self.load_key, backend_id)
        pipe.hexists(self.epoch_key, backend_id)
        fields, load, registered = pipe.execute()
        if not registered or not fields:
            return None
        return self._backend(backend_id, fields, load)

    def ids(self) -> list[str]:
        """Every registered backend id, sorted."""
        return sorted(_text(k) for k in self.client.hkeys(self.epoch_key))

    def list(self) -> list[Backend]:
        """Every registered backend with its load and state, ordered by id (a backend whose
        record is malformed is left out; see `scan`)."""
        return self.scan()[0]

    def scan(self) -> BackendScan:
        """Every registered backend with its load and state, ordered by id, and the ids of
        those whose record is malformed (logged, not raised: one bad record must not hide
        the others)."""
        ids = self.ids()
        pipe = self.client.pipeline(transaction=True)
        for backend_id in ids:
            pipe.hgetall(self.backend_key(backend_id))
        pipe.hgetall(self.load_key)
        *rows, loads = pipe.execute()
        load_of = {_text(k): v for k, v in loads.items()}
        backends: list[Backend] = []
        malformed: list[str] = []
        for backend_id, fields in zip(ids, rows, strict=True):
            if not fields:
                continue  # removed between the two reads
            try:
                backends.append(self._backend(backend_id, fields, load_of.get(backend_id)))
            except MalformedBackendError as exc:
                log.warning("%s", exc)
                malformed.append(backend_id)
        return backends, malformed

    def count(self) -> int:
        """How many backends are registered (whatever their state)."""
        return int(self.client.hlen(self.epoch_key))

    def assignable(self) -> int:
        """How many backends take new jobs now (healthy and not draining)."""
        return int(self.client.zcard(self.heap_key))

    def _backend(self, backend_id: str, fields: dict[Any, Any], load: Any) -> Backend:
        try:
            return self._parse_backend(backend_id, fields, load)
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
            # pydantic's ValidationError is a ValueError
            why = f"missing field {exc}" if isinstance(exc, KeyError) else type(exc).__name__
            raise MalformedBackendError(backend_id, why) from None

    def _parse_backend(self, backend_id: str, fields: dict[Any, Any], load: Any) -> Backend:
        data = {_text(k): _text(v) for k, v in fields.items()}
        version = data.get("policy_version", "")
        context = data.get("max_model_len", "")
        in_flight = int(_text(load)) if load is not None else 0
        if data.get("draining") == "1":
            state = "draining"
        elif data.get("healthy", "1") == "0":
            state = "dead"
        else:
            state = "healthy"
        return Backend.model_validate(
            {
                "id": backend_id,
                "url": data["url"],
                "kind": data["kind"],
                "api": data.get("api") or "completions",
                "model": data["model"],
                "capacity": float(data.get("capacity") or 1.0),
                "tokenizer": data.get("tokenizer") or None,
                "policy_version": int(version) if version else None,
                "in_flight": in_flight,
                "state": state,
                "idle": in_flight == 0,
                "failures": int(data.get("failures") or 0),
                "registered_at": float(data.get("registered_at", 0.0)),
                "max_model_len": int(context) if context else None,
                "api_key": data.get("api_key") or None,
                "weights_path": data.get("weights_path") or None,
                "started_at": float(data["started_at"]) if data.get("started_at") else None,
                "note": data.get("note") or None,
            }
        )

    # ---------------------------------------------------------------- assignment

    def route(self, job_id: str, job_key: str | None = None, final: Iterable[str] = ()) -> Route:
        """Where the job's next request goes, counted once per job.

        Sticky and idempotent: while the job holds a backend that takes work, the same one
        is returned and nothing is counted again. A job whose backend was drained, found dead
        or removed moves to the least-loaded assignable backend. Raises NoBackendError when
        none is registered and NoHealthyBackendError when none takes work now (the job then
        holds nothing). With `job_key` (the job's record, a hash with a `status` field), a job
        whose status is one of `final`, or whose record is gone, gives up its hold and
        JobEnded is raised, in the same round trip.
        """
        checks = [job_key, "," + ",".join(final) + ","] if job_key else ["", ""]
        backend_id, left, moved, version, url, ended = self._route(
            args=[self.prefix, job_id, *checks]
        )
        if int(ended):
            raise JobEnded(job_id)
        backend_id, left, version = _text(backend_id), _text(left), _text(version)
        if not backend_id:
            if self.count() == 0:
                raise NoBackendError()
            raise NoHealthyBackendError(
                "no backend takes work now: every registered backend is draining or dead"
            )
        return Route(
            backend_id,
            left if int(moved) else None,
            int(version) if version else None,
            _text(url),
        )

    def acquire(self, job_id: str) -> Backend:
        """The backend the job's requests go to (``route`` and read it)."""
        for _ in range(3):
            backend = self.get(self.route(job_id).backend_id)
            if backend is not None:
                return backend
            # Removed between the script and the read: the next route moves the job.
        raise NoBackendError("the backends were removed while a job was being assigned")

    def release(self, job_id: str) -> None:
        """Give back the job's backend; does nothing if the job holds none.

        Each hold is decremented exactly once, however often this is called, and a backend
        removed in the meantime is not brought back.
        """
        self._release(args=[self.prefix, job_id, "0"])

    def request_done(self, job_id: str) -> bool:
        """After each request: give the backend back if it no longer takes work (draining or
        dead), so a drained backend is idle as soon as its running requests have finished.
        Returns whether the hold was given up."""
        return bool(self._release(args=[self.prefix, job_id, "1"]))

    def in_flight(self) -> dict[str, int]:
        """Jobs holding each registered backend."""
        loads = {_text(k): int(_text(v)) for k, v in self.client.hgetall(self.load_key).items()}
        return {backend_id: loads.get(backend_id, 0) for backend_id in self.ids()}

    def backend_of(self, job_id: str) -> str | None:
        """The id of the backend this job holds, or None (also when that backend was removed)."""
        held = self.client.hget(self.holders_key, job_id)
        if held is None:
            return None
        backend_id, _, epoch = _text(held).partition("|")
        current = self.client.hget(self.epoch_key, backend_id)
        return backend_id if current is not None and _text(current) == epoch else None

    def holders(self) -> dict[str, str]:
        """Job id → the backend it holds (holds on removed registrations included)."""
        raw = self.client.hgetall(self.holders_key)
        return {_text(k): _text(v).partition("|")[0] for k, v in raw.items()}

    # ------------------------------------------------------------- drain and health

    def _set_field(self, backend_id: str, field: str, value: str) -> bool:
        return bool(int(self._set(args=[self.prefix, backend_id, field, value])))

    def drain(self, backend_id: str) -> bool:
        """Assign nothing new to the backend; its jobs move away after their running request.
        False for an unknown id."""
        return self._set_field(backend_id, "draining", "1")

    def resume(
        self,
        backend_id: str,
        policy_version: int | None = None,
        weights_path: str | None = None,
    ) -> bool:
        """Take work again (optionally announcing the weights it now holds, and the
        checkpoint they were loaded from). False for an unknown id."""
        if policy_version is not None and not self._set_field(
            backend_id, "policy_version", str(policy_version)
        ):
            return False
        if weights_path is not None and not self._set_field(
            backend_id, "weights_path", weights_path
        ):
            return False
        self._set_field(backend_id, "note", "")
        return self._set_field(backend_id, "draining", "0")

    def note(self, backend_id: str, why: str) -> bool:
        """Say why the service drained the backend on its own (shown until it resumes)."""
        return self._set_field(backend_id, "note", why)

    def note_started(self, backend_id: str, started_at: float) -> float | None:
        """Record when the backend's engine started; returns the time recorded before (None
        when none was, or the id is unknown). One caller sees each change: the script reads
        and writes at once."""
        _registered, before = self._note_started(args=[self.prefix, backend_id, repr(started_at)])
        text = _text(before)
        return float(text) if text else None

    def mark_dead(self, backend_id: str) -> bool:
        """Take a backend out of rotation at once (a request was lost with it); the health
        monitor re-admits it when it answers again."""
        return self._set_field(backend_id, "healthy", "0")

    def report_health(self, backend_id: str, ok: bool) -> tuple[bool, bool]:
        """Record one health check; returns (healthy before, healthy after)."""
        _registered, before, after = self._health(
            args=[self.prefix, backend_id, "1" if ok else "0", self.failure_threshold]
        )
        return bool(int(before)), bool(int(after))

    def reconcile(self, is_live: Callable[[Iterable[str]], set[str]]) -> int:
        """Drop the holds of jobs that are no longer live and rebuild every load from the rest.

        `is_live` gets the holding job ids and returns those still live. Returns how many
        loads were wrong (0 when nothing had leaked).
        """
        holding = list(self.holders())
        live = is_live(holding) if holding else set()
        dead = [job for job in holding if job not in live]
        return int(self._reconcile(args=[self.prefix, *dead]))
