"""Health of the backend fleet: periodic `/health` probes and the pool's count reconciler.

`sweep` probes every registered backend once (draining and dead ones too, so a dead one is
re-admitted as soon as it answers) and then rebuilds the pool's counts from live jobs. Workers
run it on a timer; a Redis lock makes one sweep per interval happen fleet-wide, whichever
worker takes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import redis

from api.schemas import Backend
from routing.pool import BackendPool

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0


def probe(backend: Backend, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the backend's `GET /health` answers 200 (vLLM and SGLang both serve it)."""
    try:
        answer = httpx.get(backend.url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


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
    """Probe every registered backend (in parallel) and record each result; then reconcile."""
    report = SweepReport()
    backends = pool.list()
    if backends:
        with ThreadPoolExecutor(max_workers=min(16, len(backends))) as workers:
            results = list(workers.map(check, backends))
        for backend, ok in zip(backends, results, strict=True):
            before, after = pool.report_health(backend.id, ok)
            report.probed += 1
            if before and not after:
                report.evicted.append(backend.id)
                log.warning("backend %s failed its health checks: no more work for it", backend.id)
            elif after and not before:
                report.readmitted.append(backend.id)
                log.info("backend %s answers again: re-admitted", backend.id)
    report.counts_fixed = pool.reconcile(is_live)
    if report.counts_fixed:
        log.warning("reconciled %d backend load counts from live jobs", report.counts_fixed)
    return report


def take_turn(client: redis.Redis, key: str, owner: str, interval: float) -> bool:
    """Whether this caller does the sweep of the current interval (one caller per interval
    across the fleet)."""
    ttl_ms = max(100, int(interval * 1000 * 0.9))
    return bool(client.set(key, owner, nx=True, px=ttl_ms))
