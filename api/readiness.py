"""Readiness: whether every queue has a live worker and a healthy backend is registered."""

from __future__ import annotations

import time
from threading import Lock
from typing import Any

from kombu.exceptions import KombuError
from kombu.pidbox import Mailbox
from redis.exceptions import RedisError

from api.service import Services
from broker.celery_app import QUEUES

REDIS_MISSING = "Redis (the job store and broker) answering"
REDIS_FULL = "room in Redis (it is at its maxmemory and refuses writes)"
BACKEND_MISSING = "a healthy backend"


def worker_missing(queue: str) -> str:
    return f"a worker on queue {queue}"


class _AllQueuesSeen(Exception):
    """Ends a worker broadcast early: every queue has answered, or the time is up."""


class ReadinessProbe:
    """Whether every queue has a live worker and a healthy backend is registered.

    Workers are asked with one `active_queues` broadcast on a connection and producer of its
    own (never from the app's pools, which a busy gateway may have exhausted); it stops as
    soon as every queue has a consumer and does not wait much past `timeout` seconds. One
    answer serves every probe for `ttl` seconds, so any number of probes cost at most one
    broadcast per `ttl`; a probe that cannot get an answer within `patience` seconds (a check
    stuck on an unresponsive Redis) reports Redis as missing.
    """

    def __init__(self, timeout: float = 1.0, ttl: float = 1.0, patience: float = 3.0) -> None:
        self.timeout = timeout
        self.ttl = ttl
        self.patience = patience
        self._lock = Lock()
        self._at = float("-inf")
        self._missing: list[str] = []

    def missing(self, svc: Services) -> list[str]:
        """What the service lacks to run jobs; empty when it is ready."""
        if not self._lock.acquire(timeout=self.patience):
            return [REDIS_MISSING]
        try:
            if time.monotonic() - self._at >= self.ttl:
                self._missing = self._check(svc)
                self._at = time.monotonic()
            return list(self._missing)
        finally:
            self._lock.release()

    def _check(self, svc: Services) -> list[str]:
        try:
            svc.store.r.ping()
            healthy_backends = svc.pool.assignable()
            queues = self.live_queues(svc)
        except (RedisError, KombuError, OSError) as exc:
            return [REDIS_FULL if "used memory > 'maxmemory'" in str(exc) else REDIS_MISSING]
        missing = [worker_missing(queue) for queue in QUEUES if queue not in queues]
        if healthy_backends == 0:
            missing.append(BACKEND_MISSING)
        return missing

    def live_queues(self, svc: Services) -> set[str]:
        """The queues of `QUEUES` that some live worker consumes."""
        conf = svc.celery.conf
        mailbox = Mailbox(
            conf.control_exchange,
            type="fanout",
            accept=conf.accept_content,
            serializer=conf.task_serializer,
            queue_ttl=conf.control_queue_ttl,
            reply_queue_ttl=conf.control_queue_ttl,
            queue_expires=conf.control_queue_expires,
            reply_queue_expires=conf.control_queue_expires,
        )
        seen: set[str] = set()
        deadline = time.monotonic() + self.timeout

        def on_reply(reply: dict[str, Any]) -> None:
            for worker_queues in reply.values():
                for queue in worker_queues if isinstance(worker_queues, list) else ():
                    if isinstance(queue, dict) and queue.get("name") in QUEUES:
                        seen.add(queue["name"])
            if seen.issuperset(QUEUES) or time.monotonic() > deadline:
                raise _AllQueuesSeen

        connection = svc.celery.connection_for_write(
            connect_timeout=self.timeout, transport_options={"max_retries": 1}
        )
        try:
            mailbox(connection).multi_call("active_queues", timeout=self.timeout, callback=on_reply)
        except _AllQueuesSeen:
            pass
        finally:
            connection.release()
        return seen
