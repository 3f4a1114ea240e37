"""Health of the backend fleet: periodic `/health` probes and the pool's count reconciler.

`sweep` probes every registered backend once (draining and dead ones too, so a dead one is
re-admitted as soon as it answers) and then rebuilds the pool's counts from live jobs. Workers
run it on a timer; a Redis lock makes one sweep per interval happen fleet-wide, whichever
worker takes it. Given `started_of`, it also finds engines that restarted and loads them with
their last weights again before they take work (`routing.restarts`).

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
from routing.restarts import Loader, hold, reload, restarted

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
    reloaded: list[str] = field(default_factory=list)
    """Restarted backends loaded with their last weights again."""
    reload_failed: dict[str, str] = field(default_factory=dict)
    """Restarted backends that could not be: they stay drained (why)."""


def sweep(
    pool: BackendPool,
    is_live: Callable[[Iterable[str]], set[str]],
    check: Callable[[Backend], bool] = probe,
    started_of: Callable[[Backend], float | None] | None = None,
    load: Loader | None = None,
) -> SweepReport:
    """Probe every registered backend (in parallel) and record each result; then reconcile.

    A backend whose record is malformed is not probed; it counts a failed check, so it is
    taken out of rotation like one that does not answer. With `started_of` (when an answering
    engine's process started), a restarted engine with a weight update behind it is drained
    before it is re-admitted and loaded again (`load`, by default `routing.weights`)."""
    report = SweepReport()
    backends, malformed = pool.scan()
    results: list[tuple[str, bool]] = [(backend_id, False) for backend_id in malformed]
    found: dict[str, Backend] = {b.id: b for b in backends}
    started: dict[str, float | None] = {}
    if backends:

        def look(backend: Backend) -> bool:
            ok = _checked(check, backend)
            if ok and started_of is not None:
                started[backend.id] = _started(started_of, backend)
            return ok

        with ThreadPoolExecutor(max_workers=min(16, len(backends))) as workers:
            oks = list(workers.map(look, backends))
        results += [(backend.id, ok) for backend, ok in zip(backends, oks, strict=True)]
    held: list[Backend] = []
    for backend_id, ok in sorted(results):
        backend = found.get(backend_id)
        if ok and backend is not None and backend_id in started:
            # A restarted engine is held before it is re-admitted below.
            held += _held_if_restarted(pool, backend, started[backend_id])
        before, after = pool.report_health(backend_id, ok)
        report.probed += 1
        if before and not after:
            report.evicted.append(backend_id)
            log.warning("backend %s failed its health checks: no more work for it", backend_id)
        elif after and not before:
            report.readmitted.append(backend_id)
            log.info("backend %s answers again: re-admitted", backend_id)
    for backend in held:
        why = reload(pool, backend, load)
        if why is None:
            report.reloaded.append(backend.id)
        else:
            report.reload_failed[backend.id] = why
    report.counts_fixed = pool.reconcile(is_live)
    if report.counts_fixed:
        log.warning("reconciled %d backend load counts from live jobs", report.counts_fixed)
    return report


def _held_if_restarted(
    pool: BackendPool, backend: Backend, started_at: float | None
) -> list[Backend]:
    """[backend] when it restarted with a weight update behind it (drained now), else []."""
    if not restarted(pool, backend, started_at) or backend.weights_path is None:
        return []
    hold(pool, backend)
    return [backend]


def _started(started_of: Callable[[Backend], float | None], backend: Backend) -> float | None:
    try:
        return started_of(backend)
    except Exception:
        return None


def take_turn(client: redis.Redis, key: str, owner: str, interval: float) -> bool:
    """Whether this caller does the sweep of the current interval (one caller per interval
    across the fleet)."""
    ttl_ms = max(100, int(interval * 1000 * 0.9))
    return bool(client.set(key, owner, nx=True, px=ttl_ms))
