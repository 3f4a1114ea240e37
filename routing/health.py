"""Health of the backend fleet: periodic `/health` probes and the pool's count reconciler.

`sweep` probes every registered backend once (draining and dead ones too, so a dead one is
re-admitted as soon as it answers) and then rebuilds the pool's counts from live jobs. Workers
run it on a timer; a Redis lock makes one sweep per interval happen fleet-wide, whichever
worker takes it.

One backend's bad data never stops a sweep: a probe that cannot even be sent (a URL the HTTP
client refuses) counts as a failed check, and so does a record in Redis that cannot be read
as a backend; every other backend is probed as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import redis

from core.schemas import Backend
from routing.pool import BackendPool

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0


def probe(backend: Backend, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the backend's `GET /health` answers 200 (vLLM and SGLang both serve it).

    False for anything that goes wrong, also before a request is sent (`httpx.InvalidURL`,
    `UnicodeError`, `ValueError` for a URL the client cannot use)."""
    try:
        answer = httpx.get(backend.url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError:
        return False
    except Exception as exc:  # a URL httpx refuses: this backend fails, the sweep goes on
        log.warning("backend %s cannot be probed: %s", backend.id, type(exc).__name__)
        return False
    return answer.status_code == 200


def _checked(check: Callable[[Backend], bool], backend: Backend) -> bool:
    """`check(backend)`, with anything it raises counted as a failed check."""
    try:
        return bool(check(backend))
    except Exception as exc:
        log.warning(
            "health check of backend %s raised %s: counted as failed",
            backend.id,
            type(exc).__name__,
        )
        return False


@dataclass
class SweepReport:
    """What one sweep found."""

    probed: int = 0
    evicted: list[str] = field(default_factory=list)
    readmitted: list[str] = field(default_factory=list)
    counts_fixed: int = 0


def sweep(
    pool: BackendPool,
    is_live: Callable[[Iterable[str]], set[str]],
    check: Callable[[Backend], bool] = probe,
) -> SweepReport:
    """Probe every registered backend (in parallel) and record each result; then reconcile.

    A backend whose record is malformed is not probed; it counts a failed check, so it is
    taken out of rotation like one that does not answer."""
    report = SweepReport()
    backends, malformed = pool.scan()
    results: list[tuple[str, bool]] = [(backend_id, False) for backend_id in malformed]
    if backends:
        with ThreadPoolExecutor(max_workers=min(16, len(backends))) as workers:
            oks = list(workers.map(lambda b: _checked(check, b), backends))
        results += [(backend.id, ok) for backend, ok in zip(backends, oks, strict=True)]
    for backend_id, ok in sorted(results):
        before, after = pool.report_health(backend_id, ok)
        report.probed += 1
        if before and not after:
            report.evicted.append(backend_id)
            log.warning("backend %s failed its health checks: no more work for it", backend_id)
        elif after and not before:
            report.readmitted.append(backend_id)
            log.info("backend %s answers again: re-admitted", backend_id)
    report.counts_fixed = pool.reconcile(is_live)
    if report.counts_fixed:
        log.warning("reconciled %d backend load counts from live jobs", report.counts_fixed)
    return report


def take_turn(client: redis.Redis, key: str, owner: str, interval: float) -> bool:
    """Whether this caller does the sweep of the current interval (one caller per interval
    across the fleet)."""
    ttl_ms = max(100, int(interval * 1000 * 0.9))
    return bool(client.set(key, owner, nx=True, px=ttl_ms))
