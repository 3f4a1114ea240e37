"""The registry of inference backends and the assignment of jobs to them.

Every registered backend is a member of one Redis sorted set used as a min-heap: its score
is the number of jobs that currently hold it. A job acquires the least-loaded backend and
keeps it (sticky routing, so its growing prompt hits the same server's prefix cache) until it
releases it. Acquire and release are each one Lua script, so any number of workers can call
them concurrently and every count stays exact.

Redis keys (``{p}`` is the prefix, ``rs:`` by default):

- ``{p}pool:heap`` — sorted set, member = backend id, score = jobs holding it;
- ``{p}pool:backend:{id}`` — hash: ``url``, ``kind``, ``model``, ``policy_version``
  (empty when unknown), ``registered_at``;
- ``{p}pool:epoch`` — hash, backend id → registration epoch (changes when an id is removed
  and registered again, so a job that held the old registration never counts against the new);
- ``{p}pool:epoch-seq`` — the counter that epochs are drawn from;
- ``{p}pool:job:{job_id}`` — ``"{backend_id}|{epoch}"`` while the job holds a backend,
  expiring after ``assignment_ttl`` seconds so abandoned assignments do not pile up.

This module depends on redis-py and the wire schemas only.
"""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import urlsplit

import redis

from api.schemas import Backend, BackendSpec

DEFAULT_ASSIGNMENT_TTL = 7 * 86400
"""Seconds a job's assignment is kept after its last acquire (longer than any job runs)."""


class NoBackendError(RuntimeError):
    """No inference backend is registered, so a job cannot be assigned one."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "no inference backend is registered; POST /v1/backends "
            '{"url": "http://host:8000", "model": "..."} (or start the development '
            "server with `rollserve dev-backend`) and try again"
        )


# Registering keeps the heap score of an id that is already there (its in-flight count) and
# its registered_at; a new id (or one registered again after removal) starts at 0 with a
# fresh epoch.
_REGISTER = """
local heap, bkey, epochs, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id = ARGV[1]
local created = 0
if not redis.call('ZSCORE', heap, id) then
  redis.call('ZADD', heap, 0, id)
  redis.call('HSET', epochs, id, redis.call('INCR', seq))
  redis.call('DEL', bkey)
  redis.call('HSET', bkey, 'registered_at', ARGV[6])
  created = 1
end
redis.call('HSET', bkey, 'url', ARGV[2], 'kind', ARGV[3], 'model', ARGV[4],
           'policy_version', ARGV[5])
return created
"""

_REMOVE = """
local heap, bkey, epochs = KEYS[1], KEYS[2], KEYS[3]
local removed = redis.call('ZREM', heap, ARGV[1])
redis.call('DEL', bkey)
redis.call('HDEL', epochs, ARGV[1])
return removed
"""

# A job that still holds a live registration gets it back without counting again (a
# redelivered stage may call acquire twice). Otherwise the least-loaded backend is taken;
# ZRANGE orders equal scores by member, so ties break the same way every time.
_ACQUIRE = """
local heap, epochs, jkey = KEYS[1], KEYS[2], KEYS[3]
local ttl = tonumber(ARGV[1])
local held = redis.call('GET', jkey)
if held then
  local sep = string.find(held, '|', 1, true)
  if sep then
    local id = string.sub(held, 1, sep - 1)
    if redis.call('HGET', epochs, id) == string.sub(held, sep + 1) then
      redis.call('EXPIRE', jkey, ttl)
      return id
    end
  end
end
local pick = redis.call('ZRANGE', heap, 0, 0)
if #pick == 0 then
  return false
end
local id = pick[1]
local epoch = redis.call('HGET', epochs, id)
redis.call('ZINCRBY', heap, 1, id)
redis.call('SET', jkey, id .. '|' .. epoch, 'EX', ttl)
return id
"""

# The assignment key is deleted in the same script that decrements, so a second release finds
# nothing to do. A backend that was removed (or removed and registered again, which changes
# its epoch) is left alone: ZINCRBY would otherwise recreate it in the heap.
_RELEASE = """
local heap, epochs, jkey = KEYS[1], KEYS[2], KEYS[3]
local held = redis.call('GET', jkey)
if not held then
  return false
end
redis.call('DEL', jkey)
local sep = string.find(held, '|', 1, true)
if not sep then
  return false
end
local id = string.sub(held, 1, sep - 1)
if redis.call('HGET', epochs, id) ~= string.sub(held, sep + 1) then
  return false
end
local score = redis.call('ZSCORE', heap, id)
if score and tonumber(score) > 0 then
  redis.call('ZINCRBY', heap, -1, id)
end
return id
"""

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


class BackendPool:
    """Registered inference backends and which job holds which, kept in Redis.

    Safe to use from many threads and processes at once: every change that touches the
    counts is a single Lua script.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "rs:",
        assignment_ttl: int = DEFAULT_ASSIGNMENT_TTL,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.assignment_ttl = int(assignment_ttl)
        self.heap_key = f"{prefix}pool:heap"
        self.epoch_key = f"{prefix}pool:epoch"
        self.epoch_seq_key = f"{prefix}pool:epoch-seq"
        self._register = client.register_script(_REGISTER)
        self._remove = client.register_script(_REMOVE)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)

    def backend_key(self, backend_id: str) -> str:
        return f"{self.prefix}pool:backend:{backend_id}"

    def job_key(self, job_id: str) -> str:
        return f"{self.prefix}pool:job:{job_id}"

    # ------------------------------------------------------------------ registry

    def register(self, spec: BackendSpec) -> Backend:
        """Add a backend, or update one with the same id; returns it as now registered.

        The id is ``spec.id``, or derived from the URL. Registering an id again updates its
        URL, kind, model and policy version and keeps its in-flight count and the jobs that
        hold it.
        """
        backend_id = spec.id or derive_backend_id(spec.url)
        self._register(
            keys=[
                self.heap_key,
                self.backend_key(backend_id),
                self.epoch_key,
                self.epoch_seq_key,
            ],
            args=[
                backend_id,
                spec.url,
                spec.kind,
                spec.model,
                "" if spec.policy_version is None else str(spec.policy_version),
                repr(time.time()),
            ],
        )
        backend = self.get(backend_id)
        if backend is None:  # removed by someone else in between
            raise KeyError(backend_id)
        return backend

    def remove(self, backend_id: str) -> bool:
        """Unregister a backend; False if it was not registered.

        Jobs that held it are moved to another backend on their next ``acquire``; their
        ``release`` does nothing to the counts.
        """
        removed = self._remove(
            keys=[self.heap_key, self.backend_key(backend_id), self.epoch_key],
            args=[backend_id],
        )
        return bool(int(removed))

    def get(self, backend_id: str) -> Backend | None:
        """The backend with this id and its current in-flight count, or None."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.backend_key(backend_id))
        pipe.zscore(self.heap_key, backend_id)
        fields, score = pipe.execute()
        if score is None or not fields:
            return None
        return self._backend(backend_id, fields, score)

    def list(self) -> list[Backend]:
        """Every registered backend with its current in-flight count, ordered by id."""
        scores = self.in_flight()
        ids = sorted(scores)
        pipe = self.client.pipeline(transaction=False)
        for backend_id in ids:
            pipe.hgetall(self.backend_key(backend_id))
        backends = []
        for backend_id, fields in zip(ids, pipe.execute(), strict=True):
            if fields:  # skips one removed between the two reads
                backends.append(self._backend(backend_id, fields, scores[backend_id]))
        return backends

    def count(self) -> int:
        """How many backends are registered."""
        return int(self.client.zcard(self.heap_key))

    @staticmethod
    def _backend(backend_id: str, fields: dict[Any, Any], score: float) -> Backend:
        data = {_text(k): _text(v) for k, v in fields.items()}
        version = data.get("policy_version", "")
        return Backend.model_validate(
            {
                "id": backend_id,
                "url": data["url"],
                "kind": data["kind"],
                "model": data["model"],
                "policy_version": int(version) if version else None,
                "in_flight": int(score),
                "registered_at": float(data.get("registered_at", 0.0)),
            }
        )

    # ---------------------------------------------------------------- assignment

    def acquire(self, job_id: str) -> Backend:
        """The backend this job should send its requests to, counted once per job.

        Sticky and idempotent: while the job holds a backend that is still registered, the
        same one is returned and nothing is counted again. Otherwise the least-loaded backend
        (ties broken by id) is assigned. Raises NoBackendError when none is registered.
        """
        for _ in range(3):
            backend_id = self.acquire_id(job_id)
            backend = self.get(backend_id)
            if backend is not None:
                return backend
            # Removed between the script and the read: the next acquire moves the job.
        raise NoBackendError("the backends were removed while a job was being assigned")

    def acquire_id(self, job_id: str) -> str:
        """Like ``acquire`` but returns the id only (one round trip)."""
        result = self._acquire(
            keys=[self.heap_key, self.epoch_key, self.job_key(job_id)],
            args=[self.assignment_ttl],
        )
        if result is None:
            raise NoBackendError()
        return _text(result)

    def release(self, job_id: str) -> None:
        """Give back the job's backend; does nothing if the job holds none.

        Each held assignment is decremented exactly once, however often this is called, and a
        backend removed in the meantime is not brought back.
        """
        self._release(keys=[self.heap_key, self.epoch_key, self.job_key(job_id)], args=[])

    def in_flight(self) -> dict[str, int]:
        """Jobs holding each registered backend."""
        pairs = self.client.zrange(self.heap_key, 0, -1, withscores=True)
        return {_text(member): int(score) for member, score in pairs}

    def backend_of(self, job_id: str) -> str | None:
        """The id of the backend this job holds, or None (also when that backend was removed)."""
        held = self.client.get(self.job_key(job_id))
        if held is None:
            return None
        backend_id, _, epoch = _text(held).partition("|")
        current = self.client.hget(self.epoch_key, backend_id)
        return backend_id if current is not None and _text(current) == epoch else None
