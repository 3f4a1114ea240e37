"""The shared event loop of a many-jobs RUN worker (`workers.jobsloop`): many jobs' episodes
at once from many threads, and cancellation and time limits without killing a process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from tests.support.wait import wait_until
from workers.jobsloop import JobsLoop
from workers.routed_policy import JobCancelled


class Jobs:
    """Which jobs are live, as the job store would answer."""

    def __init__(self) -> None:
        self.ended: set[str] = set()
        self.asked = 0
        self.sizes: list[int] = []
        self.reported: list[str] = []

    def live_of(self, ids: Iterable[str]) -> set[str]:
        self.asked += 1
        ids = list(ids)
        self.sizes.append(len(ids))
        return {job_id for job_id in ids if job_id not in self.ended}


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


@pytest.fixture
def loop(jobs: Jobs) -> Iterator[JobsLoop]:
    running = JobsLoop(jobs.live_of, poll=0.05, grace=0.5, on_ignored=jobs.reported.append)
    yield running
    running.close()


def test_many_threads_run_their_jobs_at_once_on_one_loop(loop: JobsLoop) -> None:
    release = threading.Event()
    loops: set[int] = set()

    async def episode(n: int) -> int:
        loops.add(id(asyncio.get_running_loop()))
        while not release.is_set():
            await asyncio.sleep(0.01)
        return n * n

    with ThreadPoolExecutor(max_workers=40) as threads:
        futures = [threads.submit(loop.run, episode(n), f"job-{n}") for n in range(40)]
        wait_until(lambda: loop.in_flight == 40, 10, "40 jobs in flight together")
        release.set()
        results = [f.result(timeout=10) for f in futures]
    assert results == [n * n for n in range(40)]
    assert len(loops) == 1 and loop.in_flight == 0


def test_an_episode_error_reaches_the_stage(loop: JobsLoop) -> None:
    async def episode() -> None:
        raise ValueError("the model's mistake")

    with pytest.raises(ValueError, match="the model's mistake"):
        loop.run(episode(), "job-err")
    assert loop.in_flight == 0


def test_a_job_past_its_time_limit_is_cancelled(loop: JobsLoop) -> None:
    unwound = threading.Event()

    async def episode() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            unwound.set()

    with pytest.raises(SoftTimeLimitExceeded):
        loop.run(episode(), "job-slow", time_limit=0.2)
    assert unwound.is_set()  # cancelled, not abandoned
    assert loop.ignored == 0 and loop.in_flight == 0


def test_a_job_ended_elsewhere_is_cancelled_by_the_watch(loop: JobsLoop, jobs: Jobs) -> None:
    started = threading.Event()
    live_when_unwound: list[bool] = []

    async def episode() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            live_when_unwound.append(loop.is_live("job-cancel"))

    with ThreadPoolExecutor(max_workers=1) as threads:
        future = threads.submit(loop.run, episode(), "job-cancel")
        assert started.wait(5)
        assert loop.is_live("job-cancel")
        jobs.ended.add("job-cancel")  # cancelled through the API, say
        with pytest.raises(JobCancelled):
            future.result(timeout=10)
    # Unwinding, the job's requests see it ended (no Redis read); once it is done here the
    # loop forgets it.
    assert live_when_unwound == [False]
    assert loop.is_live("job-cancel") and loop.in_flight == 0


def test_a_job_announced_ended_is_cancelled_without_waiting_for_the_watch(jobs: Jobs) -> None:
    feed: list[Callable[[str], None]] = []
    subscribed = threading.Event()

    def ended_feed(on_ended: Callable[[str], None], stop: threading.Event) -> None:
        feed.append(on_ended)
        subscribed.set()
        stop.wait()

    # A watch that would take a minute: only the announcement can stop the job in time.
    loop = JobsLoop(jobs.live_of, poll=60, grace=0.5, ended_feed=ended_feed)
    started = threading.Event()

    async def episode() -> None:
        started.set()
        await asyncio.sleep(60)

    try:
        assert subscribed.wait(5)
        with ThreadPoolExecutor(max_workers=1) as threads:
            future = threads.submit(loop.run, episode(), "job-pushed")
            assert started.wait(5)
            feed[0]("another-job")  # ended elsewhere, not run here: nothing happens
            feed[0]("job-pushed")
            with pytest.raises(JobCancelled):
                future.result(timeout=5)
        assert jobs.asked == 0 and loop.in_flight == 0
    finally:
        loop.close()


def test_cancel_stops_only_that_job(loop: JobsLoop) -> None:
    release = threading.Event()

    async def episode(name: str) -> str:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return name

    with ThreadPoolExecutor(max_workers=2) as threads:
        kept = threads.submit(loop.run, episode("kept"), "job-kept")
        doomed = threads.submit(loop.run, episode("doomed"), "job-doomed")
        wait_until(lambda: loop.in_flight == 2, 10, "both jobs in flight")
        assert loop.cancel("job-doomed")
        with pytest.raises(JobCancelled):
            doomed.result(timeout=10)
        release.set()
        assert kept.result(timeout=10) == "kept"
    assert not loop.cancel("job-unknown")


def test_a_job_that_ignores_cancellation_is_reported(loop: JobsLoop, jobs: Jobs) -> None:
    stop = threading.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                continue  # swallows every cancellation

    try:
        with pytest.raises(SoftTimeLimitExceeded):
            loop.run(stubborn(), "job-stubborn", time_limit=0.2)
        assert loop.ignored == 1
        assert set(loop.stuck()) == {"job-stubborn"}
        assert jobs.reported == ["job-stubborn"]  # to the job store's counter, in the worker
    finally:
        stop.set()
    wait_until(lambda: loop.in_flight == 0, 10, "the stubborn task to end")
    assert loop.stuck() == {}


def test_the_watch_reads_all_jobs_in_one_call_and_none_when_idle(jobs: Jobs) -> None:
    loop = JobsLoop(jobs.live_of, poll=0.05, grace=0.5)
    try:
        threading.Event().wait(0.3)
        assert jobs.asked == 0  # nothing in flight: no reads
        release = threading.Event()

        async def episode() -> None:
            while not release.is_set():
                await asyncio.sleep(0.01)

        with ThreadPoolExecutor(max_workers=5) as threads:
            futures = [threads.submit(loop.run, episode(), f"j{n}") for n in range(5)]
            wait_until(lambda: jobs.asked >= 3, 10, "three watch rounds")
            wait_until(lambda: 5 in jobs.sizes, 10, "a round over all five jobs")
            release.set()
            for f in futures:
                f.result(timeout=10)
        assert max(jobs.sizes) == 5  # all jobs in flight, in one read
    finally:
        loop.close()


def test_run_from_the_loop_thread_is_refused(loop: JobsLoop) -> None:
    async def inner() -> None:
        return None

    async def outer() -> None:
        coro = inner()
        try:
            loop.run(coro, "nested")
        finally:
            coro.close()

    with pytest.raises(RuntimeError, match="loop's own thread"):
        loop.run(outer(), "outer")
