"""Long waits and result streams that hold no thread of the gateway.

FastAPI runs synchronous routes in a pool of about 40 threads; a `?wait=` or a results stream
that blocked one of them for its whole length let one client with a few hundred of them open
starve every other request, `/healthz` included. Here the waiting happens on the event loop:
Redis's blocking reads (`BLPOP` on a job's wake key, `XREAD` on a batch's log of results) go
through an asyncio client, each holding a connection but no thread, and the short reads that
reuse the job store's logic run in the pool for the few milliseconds they take.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api import service
from api.service import Services
from broker.connections import BACKOFF_BASE, BACKOFF_CAP, retries_for
from broker.jobstore import JobNotFound
from broker.jobstore.base import text
from core.schemas import Backend, BatchProgress, JobStatus, Trajectory
from routing.pool import BackendPool

T = TypeVar("T")

FIRST_PAUSE = 0.02
"""Seconds between the first two reads of a polled wait; each next pause doubles it."""
LONGEST_PAUSE = 0.25
"""The longest pause between two reads of a polled wait."""
BLOCK_SECONDS = 1.0
"""Longest one blocking Redis read waits: a keep-alive goes out (or a deadline is checked)
at least this often."""
REDIS_CONNECTIONS = 2000
"""Most Redis connections the gateway's waits hold at once (each blocking read holds one for
at most `BLOCK_SECONDS`); past it a wait queues for a connection instead of failing."""
REDIS_PATIENCE = 2.0
"""Seconds a blocking read retries a lost Redis, as the gateway's other commands do."""


async def async_redis(request: Request) -> aioredis.Redis:
    """The gateway's asyncio Redis client of the running event loop (made on first use;
    `close_async_redis` closes it). A coroutine, so that FastAPI runs it on the loop."""
    return _client_of(request.app, request.app.state.services)


def _client_of(app: FastAPI, svc: Services) -> aioredis.Redis:
    loop = asyncio.get_running_loop()
    held: tuple[asyncio.AbstractEventLoop, aioredis.Redis] | None = getattr(
        app.state, "async_redis", None
    )
    if held is not None and held[0] is loop:
        return held[1]
    if not svc.settings.redis_url:
        raise RuntimeError("the gateway needs ROLLSERVE_REDIS_URL")
    retry = Retry(
        ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE),
        retries_for(REDIS_PATIENCE),
        supported_errors=(RedisConnectionError, RedisTimeoutError),
    )
    pool: aioredis.BlockingConnectionPool = aioredis.BlockingConnectionPool.from_url(
        svc.settings.redis_url, max_connections=REDIS_CONNECTIONS, timeout=None
    )
    client = aioredis.Redis(connection_pool=pool, retry=retry)
    app.state.async_redis = (loop, client)
    return client


async def close_async_redis(app: FastAPI) -> None:
    held: tuple[asyncio.AbstractEventLoop, aioredis.Redis] | None = getattr(
        app.state, "async_redis", None
    )
    app.state.async_redis = None
    if held is not None and held[0] is asyncio.get_running_loop():
        await held[1].aclose()  # type: ignore[attr-defined]  # redis>=5; older stubs


async def poll(read: Callable[[], T], ready: Callable[[T], bool], wait: float) -> T:
    """`read()` (run in the thread pool) until `ready` says so or `wait` seconds have passed;
    the pauses between reads, doubling from `FIRST_PAUSE` to `LONGEST_PAUSE`, hold no
    thread. Returns the last read."""
    deadline = time.monotonic() + wait
    pause = FIRST_PAUSE
    while True:
        value = await asyncio.to_thread(read)
        left = deadline - time.monotonic()
        if ready(value) or left <= 0:
            return value
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, LONGEST_PAUSE)


def _blocking_timeout(left: float) -> float:
    """A timeout for BLPOP: at most `BLOCK_SECONDS`, never 0 (which Redis takes as forever)."""
    return max(0.01, min(left, BLOCK_SECONDS))


async def await_job(svc: Services, r: aioredis.Redis, job_id: str, timeout: float) -> Trajectory:
    """`service.wait_for_job` without a thread held while waiting: the job's trajectory once
    it has finished, or as it is after `timeout` seconds (at most
    `ROLLSERVE_MAX_WAIT_SECONDS`). JobNotFound for an unknown job."""
    deadline = time.monotonic() + min(timeout, svc.settings.max_wait_seconds)
    record, wake = svc.store.job_key(job_id), svc.store._wake(job_id)
    raw = await r.hget(record, "status")
    if raw is None:
        raise JobNotFound(job_id)
    while not JobStatus(text(raw)).terminal:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        woke = await r.blpop([wake], timeout=_blocking_timeout(left))
        if woke is not None:
            # Put the token back so every other waiter on this job wakes too.
            await r.lpush(wake, woke[1])
        raw = await r.hget(record, "status")
        if raw is None:  # the record left Redis: the job ended and was delivered
            break
    return await asyncio.to_thread(service.deliver, svc, job_id)


async def await_batch(svc: Services, batch_id: str, wait: float) -> BatchProgress:
    """`service.wait_for_batch` without a thread held while waiting."""
    wait = min(wait, svc.settings.max_wait_seconds)
    await poll(lambda: svc.store.batch_done(batch_id), bool, wait)
    return await asyncio.to_thread(svc.store.batch_progress, batch_id)


async def cancel_batch(svc: Services, batch_id: str, wait: float) -> BatchProgress:
    """`service.cancel_batch`, waiting on the event loop."""
    await asyncio.to_thread(service.cancel_batch, svc, batch_id, 0.0)
    return await await_batch(svc, batch_id, wait)


async def await_idle(pool: BackendPool, ids: list[str], wait: float) -> list[Backend]:
    """The backends once none of them is held by a job, or as they are after `wait`
    seconds, without a thread held while waiting."""

    def read() -> list[Backend]:
        return [b for b in (pool.get(i) for i in ids) if b is not None]

    return await poll(read, lambda found: all(b.idle for b in found), wait)


_END = object()


def _step(items: Iterator[tuple[str, str] | None]) -> tuple[str, str] | object | None:
    return next(items, _END)


async def result_lines(
    svc: Services, r: aioredis.Redis, batch_id: str, after: str | None = None
) -> AsyncIterator[bytes]:
    """The lines of `GET /v1/batches/{id}/results`: every finished trajectory of the batch as
    it finishes (for a dynamic batch: the jobs of each accepted group as it is accepted,
    ending once the batch is done), each with its `cursor` (`service.result_line`), from the
    line after stream entry `after`; a blank keep-alive line after each second without news.
    A line is delivered (`service.deliver`) once the stream goes on past it.

    No thread is held while the batch has no news: the job store's own reading of the
    batch's log (`JobStore.iter_results`) runs in the pool only when the log has grown, and
    the waits between are `XREAD`s on the event loop."""
    dynamic, stream = await asyncio.to_thread(
        lambda: (svc.store.is_dynamic(batch_id), svc.store._results_stream(batch_id))
    )
    # A block of 1 ms: the store's reader looks, and says None at once when nothing is new.
    items = svc.store.iter_results(batch_id, after, block_ms=1)
    last = after or "0-0"
    idle = 0
    read = True
    try:
        while True:
            if read:
                item = await asyncio.to_thread(_step, items)
                if item is _END:
                    return
                if isinstance(item, tuple):
                    entry_id, job_id = item
                    last = entry_id
                    yield await asyncio.to_thread(_line, svc, batch_id, entry_id, job_id)
                    # the server took the line and asks for the next
                    await asyncio.to_thread(svc.store.delivered, job_id)
                    idle = 0
                    continue
                read = False
            answer = await r.xread({stream: last}, count=1, block=int(BLOCK_SECONDS * 1000))
            if answer:
                read = True
                continue
            idle += 1
            if dynamic and idle % 10 == 0:
                # now and then: pick up what a dead worker left, notice an expired batch
                await asyncio.to_thread(service.recover_batch, svc, batch_id)
                read = True
            yield b"\n"
    finally:
        close = getattr(items, "close", None)  # a generator: end its reads now
        if close is not None:
            close()


def _line(svc: Services, batch_id: str, entry_id: str, job_id: str) -> bytes:
    return service.result_line(batch_id, entry_id, svc.store.trajectory(job_id))
