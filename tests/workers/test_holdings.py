"""`workers.holdings.free`: one job whose freeing fails does not keep the others held."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from broker.jobstore import JobSpec, JobStore
from core.schemas import JobStatus
from routing.pool import BackendPool
from workers.holdings import FreeFailed, free


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def store(client: redis.Redis) -> JobStore:
    return JobStore(client)


def running_jobs(store: JobStore, count: int) -> list[str]:
    specs = [
        JobSpec(
            task={"data_source": "math", "problem": "1+1"},
            data_source="math",
            instance_id=f"t{n}",
            sampling={},
            agent={},
            group_id=f"g{n}",
            batch_id="b",
        )
        for n in range(count)
    ]
    store.create_jobs(specs, batch_id="b", group_size=1)
    for spec in specs:
        store.transition(spec.job_id, JobStatus.init)
        store.stage_finished(spec.job_id, "init", 0.1)
        store.transition(spec.job_id, JobStatus.run)
        task_id = f"{spec.job_id}-run"
        assert store.begin_stage(spec.job_id, task_id, "w", "w", 0) == "began"
    return [spec.job_id for spec in specs]


class FlakyPool(BackendPool):
    """A pool whose slot release fails for one job (Redis gone for that call)."""

    def __init__(self, client: redis.Redis, failing: str) -> None:
        super().__init__(client)
        self.failing = failing
        self.released: list[str] = []

    def release(self, job_id: str) -> None:
        if job_id == self.failing:
            raise redis.ConnectionError("connection lost")
        self.released.append(job_id)
        super().release(job_id)


def test_a_failure_on_one_job_frees_the_rest_and_is_raised(
    store: JobStore, client: redis.Redis
) -> None:
    jobs = running_jobs(store, 3)
    pool = FlakyPool(client, failing=jobs[0])
    with pytest.raises(FreeFailed) as failed:
        free(store, pool, "node-a", jobs, task_id="", sandbox=False)
    assert list(failed.value.failures) == [jobs[0]]
    assert isinstance(failed.value.__cause__, redis.ConnectionError)
    assert pool.released == jobs[1:]  # the jobs after the failing one were still freed


def test_the_other_steps_of_the_failing_job_still_run(store: JobStore, client: redis.Redis) -> None:
    [job_id] = running_jobs(store, 1)
    pool = FlakyPool(client, failing=job_id)
    with pytest.raises(FreeFailed):
        free(store, pool, "node-a", [job_id], task_id=f"{job_id}-run", sandbox=False)
    assert store.active_stage(job_id) is None  # its stage mark was cleared all the same


def test_nothing_failing_returns_what_was_freed(store: JobStore, client: redis.Redis) -> None:
    jobs = running_jobs(store, 2)
    pool = FlakyPool(client, failing="none")
    freed = free(store, pool, "node-a", jobs)
    assert pool.released == jobs and freed.here == [] and freed.elsewhere == []
