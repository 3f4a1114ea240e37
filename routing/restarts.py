"""Engines that restarted come back on the weights they last loaded, or stay out and say why.

An inference server that restarts (under `rollserve up`'s supervisor, systemd, a scheduler)
comes back with the weights it was started with, while the pool still announces the policy
version of its last update: every trajectory it served would be labelled with weights it does
not hold. So the health sweep also asks each answering engine when its process started
(`process_start_time_seconds` on `/metrics`, which vLLM and the development server serve); an
engine that does not say counts a return from the dead as a restart.

A restarted engine whose last update loaded a checkpoint (`weights_path`) is drained before
it is re-admitted, loaded with that checkpoint again, and resumes under the same policy
version; its `note` says what happens meanwhile. If the load fails it stays drained, the note
saying why, until an operator updates its weights or resumes it. An engine never updated holds
the weights it announces and goes back to work as it is. An engine drained by an operator
stays drained after the reload.

Between a restart and the next sweep (`ROLLSERVE_HEALTH_INTERVAL`) the engine could be routed
a request only if it restarted faster than that and no request was in flight with it (one
in flight fails at the restart, and the backend is taken out until a sweep sees it again).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

import httpx

from core.fleet import Backend
from routing.pool import BackendPool
from routing.vllm import bearer
from routing.weights import WeightUpdateError, load_weights

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0
RELOAD_TIMEOUT = 600.0
"""Seconds a restarted engine may take to load its weights again."""
STARTED = re.compile(r"^process_start_time_seconds(?:\{[^}]*\})? (\S+)$", re.MULTILINE)

Loader = Callable[[Backend, str], Awaitable[float]]


def engine_started(backend: Backend, timeout: float = PROBE_TIMEOUT) -> float | None:
    """When the engine's process started, from its `/metrics`; None when it does not say."""
    try:
        answer = httpx.get(
            backend.url.rstrip("/") + "/metrics", headers=bearer(backend.api_key), timeout=timeout
        )
    except Exception:  # an engine that cannot be asked is judged by its health alone
        return None
    found = STARTED.search(answer.text) if answer.status_code == 200 else None
    try:
        return float(found[1]) if found else None
    except ValueError:
        return None


def restarted(pool: BackendPool, backend: Backend, started_at: float | None) -> bool:
    """Whether `backend` (as the sweep found it, before its health is recorded) restarted
    since the last sweep; records the start time it reports now."""
    if started_at is None:
        return backend.state == "dead"
    before = pool.note_started(backend.id, started_at)
    return before is not None and abs(before - started_at) > 1e-3


def hold(pool: BackendPool, backend: Backend) -> None:
    """Take the restarted backend out before it is re-admitted: it reloads first."""
    pool.drain(backend.id)
    pool.note(
        backend.id,
        f"restarted: loading {backend.weights_path} again (policy version "
        f"{backend.policy_version}) before it takes work",
    )


async def _load(backend: Backend, path: str) -> float:
    return await load_weights(
        backend, path, timeout=RELOAD_TIMEOUT, weight_version=str(backend.policy_version)
    )


def reload(pool: BackendPool, backend: Backend, load: Loader | None = None) -> str | None:
    """Load the held backend's last weights again and let it work under its policy version
    (unless an operator had drained it); None, or why it stays drained."""
    assert backend.weights_path is not None
    try:
        seconds = asyncio.run(_run((load or _load)(backend, backend.weights_path)))
    except WeightUpdateError as exc:
        why = f"restarted, and loading {backend.weights_path} again failed: {exc.message}"
    except Exception as exc:
        why = f"restarted, and loading {backend.weights_path} again failed: {exc!r}"
    else:
        if backend.state == "draining":  # drained by an operator before it restarted
            pool.note(backend.id, "")
        else:
            pool.resume(backend.id, backend.policy_version)
        log.info(
            "backend %s restarted: loaded %s again in %.1fs (policy version %s)",
            backend.id,
            backend.weights_path,
            seconds,
            backend.policy_version,
        )
        return None
    pool.note(backend.id, why)
    log.error("backend %s stays drained: %s", backend.id, why)
    return why


async def _run(work: Awaitable[float]) -> float:
    return await work
