"""Which worker holds a stage, and its heartbeat.

A worker's identity is its main process's `node|pid|start time`, taken when the worker starts
(`worker_init`, before the prefork pool forks) so that every pool process reports the same
one: it is what a stage mark names as its holder (`active_owner`). The worker's heartbeat
thread writes that identity's key, and one key per stage it takes on its node, every
`ROLLSERVE_HEARTBEAT_INTERVAL` seconds with a time to live of `ROLLSERVE_HEARTBEAT_TTL`; when
the main process dies, both stop, and the sweeper (`workers.sweeper`) takes over its stages.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from broker.celery_app import QUEUES
from sandbox.procs import process_start_time
from workers.process_state import Runtime, get_runtime

log = logging.getLogger(__name__)

_identity: tuple[str, list[str]] | None = None
"""This worker's owner id and the stages it takes, once `register` ran in its main process."""
_beats: dict[str, float] = {"ok": 0.0, "failed": 0.0}
"""When this process last wrote its heartbeat, and when a write last failed (monotonic)."""


def process_id(node: str, pid: int | None = None) -> str:
    """`node|pid|start time` of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{node}|{pid}|{process_start_time(pid) or ''}"


def owner(rt: Runtime) -> str:
    """The heartbeat id of the worker this process belongs to (its own id outside a worker)."""
    return _identity[0] if _identity is not None else process_id(rt.settings.node_name)


def stages_of(queues: list[str]) -> list[str]:
    """The stages a worker consuming `queues` takes (`run` for `run` and `run.<node>`)."""
    return [stage for stage in QUEUES if any(q.split(".", 1)[0] == stage for q in queues)]


def consumed_queues(worker: Any) -> list[str]:
    """The queue names a starting worker consumes (every stage's when it cannot tell)."""
    try:
        queues = worker.app.amqp.queues.consume_from
    except AttributeError:
        return list(QUEUES)
    return [str(q) for q in queues] if queues else list(QUEUES)


def register(queues: list[str]) -> str:
    """In a starting worker's main process: fix its identity and beat once, so that no stage
    it begins is ever held by a worker without a heartbeat."""
    global _identity
    rt = get_runtime()
    _identity = (process_id(rt.settings.node_name), stages_of(queues))
    beat(rt)
    return _identity[0]


def beat(rt: Runtime) -> None:
    """Write this worker's heartbeat and its node's (one key per stage it takes)."""
    me, stages = _identity if _identity is not None else (owner(rt), list(QUEUES))
    settings = rt.settings
    rt.store.beat(me, settings.node_name, stages, settings.heartbeat_ttl)


def beat_forever() -> None:
    """Every `ROLLSERVE_HEARTBEAT_INTERVAL` seconds, write the heartbeat (errors are logged
    and the next beat tried: a Redis that is away for longer than the TTL makes this worker
    look dead, and its stages are sent again, as for a worker that died)."""
    while True:
        rt = get_runtime()
        try:
            beat(rt)
            _beats["ok"] = time.monotonic()
        except Exception:
            _beats["failed"] = time.monotonic()
            log.exception("writing the worker heartbeat failed")
        time.sleep(rt.settings.heartbeat_interval)


def steady(ttl: float) -> bool:
    """Whether this process's heartbeats have gone through for the last `ttl` seconds: after
    Redis was away that long, every worker's heartbeat has lapsed, and a sweep must wait for
    them to beat again before it takes anyone's stages for dead."""
    now = time.monotonic()
    return now - _beats["ok"] < ttl and now - _beats["failed"] > ttl
