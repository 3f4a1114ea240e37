"""Backend health sweeps against real HTTP servers and a real Redis pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from broker.processes import free_port
from core.schemas import BackendSpec
from routing.health import sweep, take_turn
from routing.pool import BackendPool
from tests.support.stub import Answer, StubServer


class HealthServer(StubServer):
    """Answers `GET /health` with `status` (changeable while it runs)."""

    def __init__(self) -> None:
        self.status = 200
        super().__init__(self.answer)

    def answer(self, method: str, path: str) -> Answer:
        return (self.status if path == "/health" else 404), {}, b""


@pytest.fixture
def health_server() -> Iterator[HealthServer]:
    running = HealthServer()
    yield running
    running.close()


def test_sweep_evicts_after_repeated_failures_and_readmits(
    redis_client: redis.Redis, health_server: HealthServer
) -> None:
    pool = BackendPool(redis_client, failure_threshold=2)
    pool.register(BackendSpec(url=health_server.url, model="m", id="up"))
    pool.register(BackendSpec(url=f"http://127.0.0.1:{free_port()}", model="m", id="gone"))
    everyone_live = lambda jobs: set(jobs)  # noqa: E731

    first = sweep(pool, everyone_live)
    assert first.probed == 2 and first.evicted == [] and pool.get("gone").failures == 1  # type: ignore[union-attr]
    second = sweep(pool, everyone_live)
    assert second.evicted == ["gone"] and pool.get("gone").state == "dead"  # type: ignore[union-attr]
    assert pool.acquire("job").id == "up"

    health_server.status = 503
    sweep(pool, everyone_live)
    assert sweep(pool, everyone_live).evicted == ["up"]
    health_server.status = 200
    assert sweep(pool, everyone_live).readmitted == ["up"]
    assert pool.get("up").state == "healthy"  # type: ignore[union-attr]


def test_sweep_reconciles_counts_of_ended_jobs(
    redis_client: redis.Redis, health_server: HealthServer
) -> None:
    pool = BackendPool(redis_client)
    pool.register(BackendSpec(url=health_server.url, model="m", id="up"))
    pool.acquire("ended")
    pool.acquire("running")
    report = sweep(pool, lambda jobs: {j for j in jobs if j == "running"})
    assert report.counts_fixed == 1 and pool.in_flight() == {"up": 1}


def test_one_sweeper_per_interval(redis_client: redis.Redis) -> None:
    assert take_turn(redis_client, "rs:lock", "w1", 5.0)
    assert not take_turn(redis_client, "rs:lock", "w2", 5.0)
