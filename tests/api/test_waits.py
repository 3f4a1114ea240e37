"""The gateway's long waits on the event loop (`api.waits`), called directly over a real Redis:
they answer as the synchronous waits of `api.service` do."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from api.service import Services, submit_batch, submit_rollout
from api.waits import await_batch, await_idle, await_job, cancel_batch, poll, result_lines
from broker.jobstore import JobNotFound
from core.schemas import BatchRequest, JobStatus, RolloutRequest

TASK = {"data_source": "math", "problem": "What is 1+1?", "answer": "2"}


def finish(svc: Services, job_id: str, reward: float = 1.0) -> None:
    trajectory = svc.store.skeleton(svc.store.get(job_id))
    trajectory.reward = reward
    svc.store.finish(job_id, JobStatus.completed, trajectory)


async def with_redis(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url)


def test_await_job_answers_once_the_job_ends(svc: Services, redis_url: str) -> None:
    job_id = submit_rollout(svc, RolloutRequest.model_validate({"task": TASK}))

    async def wait() -> JobStatus:
        r = await with_redis(redis_url)
        try:
            waiting = asyncio.create_task(await_job(svc, r, job_id, 120.0))
            # finish it from another thread once the wait is under way
            await asyncio.sleep(0)
            finisher.start()
            return (await waiting).status
        finally:
            await r.aclose()

    # The wait answers once the end is recorded, before `finish` has moved the trajectory on:
    # the thread is joined, so it never outlives the test (and the store it writes to).
    finisher = threading.Thread(target=finish, args=(svc, job_id))
    try:
        assert asyncio.run(wait()) is JobStatus.completed
    finally:
        finisher.join(timeout=30)
    assert not finisher.is_alive()


def test_await_job_gives_the_job_as_it_is_after_the_timeout(svc: Services, redis_url: str) -> None:
    job_id = submit_rollout(svc, RolloutRequest.model_validate({"task": TASK}))

    async def wait() -> JobStatus:
        r = await with_redis(redis_url)
        try:
            return (await await_job(svc, r, job_id, 0.05)).status
        finally:
            await r.aclose()

    assert asyncio.run(wait()) is JobStatus.queued


def test_await_job_of_an_unknown_job_is_not_found(svc: Services, redis_url: str) -> None:
    async def wait() -> None:
        r = await with_redis(redis_url)
        try:
            await await_job(svc, r, "0" * 32, 1.0)
        finally:
            await r.aclose()

    with pytest.raises(JobNotFound):
        asyncio.run(wait())


async def collect(lines: AsyncIterator[bytes], keepalives: int) -> list[bytes]:
    """The lines of a stream until it ends, or until `keepalives` blank lines came."""
    got: list[bytes] = []
    blanks = 0
    async for line in lines:
        got.append(line)
        blanks += line == b"\n"
        if blanks >= keepalives:
            break
    return got


def test_result_lines_stream_every_finished_job_then_end(svc: Services, redis_url: str) -> None:
    batch_id, jobs = submit_batch(
        svc, BatchRequest.model_validate({"tasks": [TASK], "group_size": 2})
    )
    finish(svc, jobs[0])

    async def stream() -> list[bytes]:
        r = await with_redis(redis_url)
        try:
            lines = result_lines(svc, r, batch_id)
            first = await anext(lines)
            finisher.start()
            return [first, *await collect(lines, keepalives=100)]
        finally:
            await r.aclose()

    finisher = threading.Thread(target=finish, args=(svc, jobs[1], 0.0))
    try:
        streamed = asyncio.run(stream())
    finally:
        finisher.join(timeout=30)
    lines = [json.loads(line) for line in streamed if line.strip()]
    assert [line["job_id"] for line in lines] == jobs
    assert all(line["cursor"] for line in lines)

    # resuming after the first line's cursor gives the second only
    async def resume() -> list[bytes]:
        r = await with_redis(redis_url)
        try:
            entry = lines[0]["cursor"].split(".")[0]
            return await collect(result_lines(svc, r, batch_id, entry), keepalives=100)
        finally:
            await r.aclose()

    again = [json.loads(line) for line in asyncio.run(resume()) if line.strip()]
    assert [line["job_id"] for line in again] == [jobs[1]]


def test_result_lines_send_keepalives_while_nothing_finishes(svc: Services, redis_url: str) -> None:
    batch_id, _ = submit_batch(svc, BatchRequest.model_validate({"tasks": [TASK]}))

    async def stream() -> list[bytes]:
        r = await with_redis(redis_url)
        try:
            return await collect(result_lines(svc, r, batch_id), keepalives=2)
        finally:
            await r.aclose()

    assert asyncio.run(stream()) == [b"\n", b"\n"]


def test_cancel_batch_waits_until_every_job_has_stopped(svc: Services) -> None:
    batch_id, _ = submit_batch(svc, BatchRequest.model_validate({"tasks": [TASK], "group_size": 3}))
    progress = asyncio.run(cancel_batch(svc, batch_id, 30.0))
    assert progress.done and progress.counts.get("cancelled") == 3
    assert asyncio.run(await_batch(svc, batch_id, 0.0)).done


def test_await_idle_answers_with_the_backends_as_they_are(svc: Services) -> None:
    svc.pool.drain("b")
    backends = asyncio.run(await_idle(svc.pool, ["b", "gone"], 5.0))
    assert [(b.id, b.idle) for b in backends] == [("b", True)]


def test_poll_reads_until_ready_or_the_time_is_up() -> None:
    reads = iter(range(100))
    assert asyncio.run(poll(lambda: next(reads), lambda n: n >= 3, 30.0)) == 3
    assert asyncio.run(poll(lambda: 7, lambda _n: False, 0.0)) == 7
