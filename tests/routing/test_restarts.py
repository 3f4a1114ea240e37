"""Engines that restart (`routing.restarts`) through the health sweep, on a real Redis pool:
held before they are re-admitted, loaded with their last weights again, and only then back
at work under their policy version; or left drained, saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core.fleet import Backend
from core.schemas import BackendSpec
from routing.health import sweep
from routing.pool import BackendPool
from routing.restarts import engine_started
from routing.weights import WeightUpdateError
from tests.support.stub import Answer, StubServer

UP = "http://127.0.0.1:9"
"""Never asked: the sweeps here are given their checks."""


class Engine:
    """What the sweep asks of one engine: whether it answers, when it started; and the loads
    it was given."""

    def __init__(self) -> None:
        self.healthy = True
        self.started: float | None = 1000.0
        self.loads: list[tuple[str, str, int | None]] = []
        self.fail: str | None = None

    def check(self, backend: Backend) -> bool:
        return self.healthy

    def started_of(self, backend: Backend) -> float | None:
        return self.started

    async def load(self, backend: Backend, path: str) -> float:
        self.loads.append((backend.id, path, backend.policy_version))
        if self.fail is not None:
            raise WeightUpdateError(backend, self.fail)
        return 0.5


@pytest.fixture
def engine() -> Engine:
    return Engine()


def run_sweep(pool: BackendPool, engine: Engine) -> object:
    return sweep(
        pool, lambda ids: set(), engine.check, started_of=engine.started_of, load=engine.load
    )


def updated(pool: BackendPool, path: str = "/ckpt/v2", version: int = 2) -> Backend:
    """The backend `b` registered, then switched to `path` as an update does."""
    pool.register(BackendSpec(url=UP, model="m", id="b", policy_version=1))
    pool.drain("b")
    assert pool.resume("b", version, path)
    backend = pool.get("b")
    assert backend is not None
    return backend


def test_a_restarted_engine_is_loaded_again_before_it_takes_work(
    pool: BackendPool, engine: Engine
) -> None:
    backend = updated(pool)
    assert backend.weights_path == "/ckpt/v2" and backend.policy_version == 2
    run_sweep(pool, engine)  # the start time is recorded
    assert engine.loads == [] and pool.get("b").started_at == 1000.0  # type: ignore[union-attr]
    engine.started = 2000.0  # it restarted between two sweeps
    report = run_sweep(pool, engine)
    assert engine.loads == [("b", "/ckpt/v2", 2)]
    after = pool.get("b")
    assert after is not None
    assert (after.state, after.policy_version, after.note) == ("healthy", 2, None)
    assert after.started_at == 2000.0
    assert report.reloaded == ["b"]  # type: ignore[attr-defined]
    run_sweep(pool, engine)  # the same engine: nothing more to do
    assert len(engine.loads) == 1


def test_it_is_not_routed_while_it_loads(pool: BackendPool, engine: Engine) -> None:
    updated(pool)
    run_sweep(pool, engine)
    engine.started = 2000.0
    seen: list[Backend | None] = []

    async def watching(backend: Backend, path: str) -> float:
        seen.append(pool.get("b"))
        return await engine.load(backend, path)

    sweep(pool, lambda ids: set(), engine.check, started_of=engine.started_of, load=watching)
    [during] = seen
    assert during is not None and during.state == "draining"
    assert during.note is not None and "loading /ckpt/v2 again" in during.note
    assert pool.assignable() == 1  # back once loaded


def test_a_failed_load_leaves_it_drained_saying_why(pool: BackendPool, engine: Engine) -> None:
    updated(pool)
    run_sweep(pool, engine)
    engine.started, engine.fail = 2000.0, "the checkpoint is gone"
    report = run_sweep(pool, engine)
    after = pool.get("b")
    assert after is not None and after.state == "draining"
    assert after.note is not None and "the checkpoint is gone" in after.note
    assert "b" in report.reload_failed  # type: ignore[attr-defined]
    run_sweep(pool, engine)
    assert len(engine.loads) == 1  # not retried every sweep: an operator decides
    assert pool.resume("b") and pool.get("b").note is None  # type: ignore[union-attr]


def test_an_engine_never_updated_goes_back_to_work_as_it_is(
    pool: BackendPool, engine: Engine
) -> None:
    pool.register(BackendSpec(url=UP, model="m", id="b", policy_version=1))
    run_sweep(pool, engine)
    engine.started = 2000.0
    run_sweep(pool, engine)
    after = pool.get("b")
    assert engine.loads == [] and after is not None and after.state == "healthy"


def test_an_operators_drain_outlives_the_reload(pool: BackendPool, engine: Engine) -> None:
    updated(pool)
    run_sweep(pool, engine)
    pool.drain("b")
    engine.started = 2000.0
    run_sweep(pool, engine)
    after = pool.get("b")
    assert len(engine.loads) == 1
    assert after is not None and after.state == "draining" and after.note is None


def test_without_a_start_time_a_return_from_the_dead_counts_as_a_restart(
    pool: BackendPool, engine: Engine
) -> None:
    updated(pool)
    engine.started = None
    run_sweep(pool, engine)
    assert engine.loads == []
    engine.healthy = False
    for _ in range(pool.failure_threshold):
        run_sweep(pool, engine)
    assert pool.get("b").state == "dead"  # type: ignore[union-attr]
    engine.healthy = True
    run_sweep(pool, engine)
    assert engine.loads == [("b", "/ckpt/v2", 2)]
    assert pool.get("b").state == "healthy"  # type: ignore[union-attr]


class MetricsServer(StubServer):
    def __init__(self, body: bytes, status: int = 200) -> None:
        self.body, self.status = body, status
        super().__init__(lambda method, path: self.answer(path))

    def answer(self, path: str) -> Answer:
        return (self.status if path == "/metrics" else 404), {}, self.body


@pytest.fixture
def metrics_server() -> Iterator[MetricsServer]:
    running = MetricsServer(b"")
    yield running
    running.close()


def test_the_start_time_is_read_from_the_engines_metrics(metrics_server: MetricsServer) -> None:
    backend = Backend(id="b", url=metrics_server.url, kind="vllm", model="m", registered_at=0.0)
    metrics_server.body = (
        b"# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
        b"# TYPE process_start_time_seconds gauge\n"
        b"process_start_time_seconds 1.79665e+09\n"
        b'vllm:num_requests_running{engine="0"} 0.0\n'
    )
    assert engine_started(backend) == 1.79665e09
    metrics_server.body = b'vllm:num_requests_running{engine="0"} 0.0\n'
    assert engine_started(backend) is None
    metrics_server.status = 500
    assert engine_started(backend) is None
    gone = backend.model_copy(update={"url": "http://127.0.0.1:9"})
    assert engine_started(gone, timeout=1) is None
