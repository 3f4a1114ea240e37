"""The backend pool against a real Redis: registry, least-loaded sticky assignment, races."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import redis

from core.schemas import BackendSpec
from routing.pool import (
    DEFAULT_FAILURE_THRESHOLD,
    BackendPool,
    JobEnded,
    NoBackendError,
    NoHealthyBackendError,
    Route,
    derive_backend_id,
)


@pytest.fixture
def raw_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client that does not decode responses (the pool must work with both kinds)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def spec(url: str, model: str = "qwen3-8b", **extra: object) -> BackendSpec:
    return BackendSpec.model_validate({"url": url, "model": model, **extra})


def test_derive_backend_id_is_readable_and_stable() -> None:
    assert derive_backend_id("http://gpu-node-3:8000") == "gpu-node-3-8000"
    assert derive_backend_id("http://gpu-node-3:8000/") == "gpu-node-3-8000"
    assert derive_backend_id("https://api.example.org") == "api.example.org-443"
    assert derive_backend_id("http://h:9000/v1/x") == "h-9000-v1_x"
    assert derive_backend_id("http://[::1]:8000") == "::1-8000"
    BackendSpec(url="http://x:1", model="m", id=derive_backend_id("http://h:9000/v1/x"))


def test_register_list_get_count(pool: BackendPool) -> None:
    a = pool.register(spec("http://gpu-a:8000", policy_version=3))
    b = pool.register(spec("http://gpu-b:8000", kind="sglang", id="b"))
    assert a.id == "gpu-a-8000" and a.policy_version == 3 and a.kind == "vllm"
    assert b.id == "b" and b.kind == "sglang" and b.policy_version is None
    assert pool.count() == 2
    assert [x.id for x in pool.list()] == ["b", "gpu-a-8000"]
    got = pool.get("b")
    assert got is not None and got.url == "http://gpu-b:8000" and got.in_flight == 0
    assert pool.get("nope") is None


def test_reregister_updates_fields_and_keeps_in_flight(pool: BackendPool) -> None:
    first = pool.register(spec("http://gpu-a:8000", id="a", policy_version=1))
    pool.acquire("j1")
    pool.acquire("j2")
    again = pool.register(spec("http://gpu-a2:8001", model="new", id="a", policy_version=2))
    assert again.url == "http://gpu-a2:8001" and again.model == "new"
    assert again.policy_version == 2
    assert again.in_flight == 2
    assert again.registered_at == first.registered_at
    # The jobs still hold it: acquiring again does not count them twice.
    assert pool.acquire("j1").id == "a"
    assert pool.in_flight() == {"a": 2}


def test_acquire_picks_least_loaded_with_deterministic_ties(pool: BackendPool) -> None:
    for name in ("c", "a", "b"):
        pool.register(spec(f"http://{name}:8000", id=name))
    # Ties go by id, so three jobs spread a, b, c in that order.
    assert [pool.acquire(f"j{i}").id for i in range(3)] == ["a", "b", "c"]
    pool.release("j1")  # b drops to 0
    assert pool.acquire("j3").id == "b"
    assert pool.in_flight() == {"a": 1, "b": 1, "c": 1}
    assert pool.acquire("j4").id == "a"
    assert pool.in_flight() == {"a": 2, "b": 1, "c": 1}


def test_acquire_is_sticky_and_idempotent(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    first = pool.acquire("job")
    for _ in range(5):
        assert pool.acquire("job").id == first.id
    assert pool.in_flight() == {first.id: 1, ("b" if first.id == "a" else "a"): 0}
    assert pool.backend_of("job") == first.id


def test_release_is_idempotent(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.acquire("job")
    pool.acquire("job")
    assert pool.in_flight() == {"a": 1}
    pool.release("job")
    pool.release("job")
    pool.release("never-acquired")
    assert pool.in_flight() == {"a": 0}
    assert pool.backend_of("job") is None
    # Holding again after a release counts again.
    pool.acquire("job")
    assert pool.in_flight() == {"a": 1}


def test_reconcile_drops_holds_of_dead_jobs_and_rebuilds_counts(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    for job in ("j1", "j2", "j3"):
        pool.acquire(job)
    assert pool.in_flight() == {"a": 2, "b": 1}
    # A worker died without releasing j1 and j3, and a count was corrupted.
    redis_client.hset(pool.load_key, "b", 7)
    seen: list[str] = []

    def live(jobs: object) -> set[str]:
        seen.extend(jobs)  # type: ignore[call-overload]
        return {"j2"}

    assert pool.reconcile(live) == 2
    assert sorted(seen) == ["j1", "j2", "j3"]
    assert pool.in_flight() == {"a": 0, "b": 1}
    assert pool.holders() == {"j2": "b"}
    # Nothing leaked: a second pass changes nothing, and the heap follows the counts.
    assert pool.reconcile(lambda jobs: set(jobs)) == 0
    assert pool.acquire("j4").id == "a"


def test_capacity_weights_the_least_loaded_choice(pool: BackendPool) -> None:
    pool.register(spec("http://big:8000", id="big", capacity=3))
    pool.register(spec("http://small:8000", id="small", capacity=1))
    for i in range(8):
        pool.acquire(f"j{i}")
    assert pool.in_flight() == {"big": 6, "small": 2}
    assert pool.get("big").capacity == 3.0  # type: ignore[union-attr]


def test_drain_moves_jobs_after_their_request_and_reports_idle(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    assert pool.acquire("j1").id == "a"
    assert pool.acquire("j2").id == "b"
    assert pool.drain("a")
    drained = pool.get("a")
    assert drained is not None and drained.state == "draining" and not drained.idle
    # Nothing new goes to a draining backend.
    assert pool.acquire("j3").id == "b"
    # j1's running request finishes: the hold is given up at once, so a is idle.
    assert pool.request_done("j1") is True
    assert pool.request_done("j2") is False  # b still takes work: j2 stays sticky
    drained = pool.get("a")
    assert drained is not None and drained.idle and drained.in_flight == 0
    # j1's next request moves to the least-loaded backend that takes work.
    route = pool.route("j1")
    assert route.backend_id == "b" and not route.moved  # the hold was already given up
    assert pool.in_flight() == {"a": 0, "b": 3}
    assert pool.resume("a", policy_version=5)
    resumed = pool.get("a")
    assert resumed is not None and resumed.state == "healthy" and resumed.policy_version == 5
    assert pool.acquire("j4").id == "a"
    assert not pool.drain("nope") and not pool.resume("nope")


def test_a_job_on_a_drained_backend_moves_on_its_next_route(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    pool.acquire("j1")
    pool.drain("a")
    route = pool.route("j1")
    assert route.backend_id == "b" and route.left == "a" and route.moved
    assert pool.in_flight() == {"a": 0, "b": 1}


def test_all_drained_raises_no_healthy_backend(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.acquire("j1")
    pool.drain("a")
    with pytest.raises(NoHealthyBackendError, match="draining or dead"):
        pool.route("j1")
    assert pool.in_flight() == {"a": 0} and pool.backend_of("j1") is None
    pool.resume("a")
    assert pool.route("j1").backend_id == "a"


def test_health_failures_evict_and_a_success_readmits(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    assert pool.acquire("j1").id == "a"
    for _ in range(DEFAULT_FAILURE_THRESHOLD - 1):
        assert pool.report_health("a", False) == (True, True)
    assert pool.get("a").failures == DEFAULT_FAILURE_THRESHOLD - 1  # type: ignore[union-attr]
    assert pool.report_health("a", False) == (True, False)
    assert pool.get("a").state == "dead"  # type: ignore[union-attr]
    assert pool.route("j1").backend_id == "b"
    assert pool.acquire("j2").id == "b"
    assert pool.report_health("a", True) == (False, True)
    back = pool.get("a")
    assert back is not None and back.state == "healthy" and back.failures == 0
    assert pool.acquire("j3").id == "a"


def test_mark_dead_takes_a_backend_out_at_once(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    pool.acquire("j1")
    assert pool.mark_dead("a")
    assert pool.route("j1") == Route("b", left="a", url="http://b:8000")
    # Draining and dead at once: resume alone does not bring back a dead backend.
    pool.drain("a")
    pool.resume("a")
    assert pool.get("a").state == "dead"  # type: ignore[union-attr]
    assert pool.assignable() == 1


def test_reregistering_keeps_drain_and_load(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.acquire("j1")
    pool.drain("a")
    again = pool.register(spec("http://a:8000", id="a", policy_version=9))
    assert again.state == "draining" and again.in_flight == 1 and again.policy_version == 9


def test_remove_reassigns_and_release_does_not_recreate(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    assert pool.acquire("j1").id == "a"
    assert pool.acquire("j2").id == "b"
    assert pool.remove("a") is True
    assert pool.remove("a") is False
    assert pool.get("a") is None
    assert pool.backend_of("j1") is None
    # Releasing a job whose backend is gone leaves the heap alone.
    pool.release("j1")
    assert pool.in_flight() == {"b": 1}
    assert pool.count() == 1
    # A job whose backend was removed is moved on its next acquire.
    assert pool.acquire("j3").id == "b"
    pool.acquire("j1")
    assert pool.backend_of("j1") == "b"
    assert pool.in_flight() == {"b": 3}


def test_held_job_moves_when_its_backend_is_removed(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    assert pool.acquire("job").id == "a"
    pool.remove("a")
    assert pool.acquire("job").id == "b"
    assert pool.acquire("job").id == "b"
    assert pool.in_flight() == {"b": 1}
    pool.release("job")
    assert pool.in_flight() == {"b": 0}


def test_reregistered_id_does_not_inherit_old_jobs(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.acquire("old")
    pool.remove("a")
    pool.register(spec("http://a:8000", id="a"))
    assert pool.backend_of("old") is None
    pool.acquire("new")
    pool.release("old")  # belongs to the previous registration: must not decrement
    assert pool.in_flight() == {"a": 1}
    # The old job is counted afresh when it comes back.
    pool.acquire("old")
    assert pool.in_flight() == {"a": 2}


def test_no_backend_error(pool: BackendPool) -> None:
    with pytest.raises(NoBackendError, match="POST /v1/backends"):
        pool.acquire("job")
    pool.register(spec("http://a:8000", id="a"))
    pool.acquire("job")
    pool.remove("a")
    with pytest.raises(NoBackendError):
        pool.acquire("job")
    pool.release("job")
    assert pool.in_flight() == {}


def test_listing_shows_in_flight(pool: BackendPool) -> None:
    pool.register(spec("http://a:8000", id="a"))
    pool.register(spec("http://b:8000", id="b"))
    for i in range(3):
        pool.acquire(f"j{i}")
    listed = {b.id: b.in_flight for b in pool.list()}
    assert listed == {"a": 2, "b": 1}
    assert sum(listed.values()) == 3


def test_works_without_decoded_responses(raw_client: redis.Redis) -> None:
    pool = BackendPool(raw_client, prefix="t:")
    pool.register(spec("http://a:8000", id="a", policy_version=7))
    assert pool.acquire("job").id == "a"
    assert pool.backend_of("job") == "a"
    assert pool.in_flight() == {"a": 1}
    [listed] = pool.list()
    assert listed.policy_version == 7 and listed.in_flight == 1
    pool.release("job")
    assert pool.in_flight() == {"a": 0}


def test_concurrent_acquire_release_keeps_counts_exact(pool: BackendPool, redis_url: str) -> None:
    for name in ("a", "b", "c", "d"):
        pool.register(spec(f"http://{name}:8000", id=name))
    errors: list[BaseException] = []
    negative: list[dict[str, int]] = []
    stop = threading.Event()
    start = threading.Barrier(51)

    def worker(n: int) -> None:
        client = redis.Redis.from_url(redis_url, decode_responses=bool(n % 2))
        mine = BackendPool(client)
        rng = random.Random(n)
        try:
            start.wait()
            for i in range(20):
                # Half the jobs are shared between two threads, as with a redelivered stage.
                shared = n % 4 < 2
                job = f"shared-{n // 2}-{i}" if shared else f"own-{n}-{i}"
                held = mine.acquire(job)
                again = mine.acquire(job)
                # The partner thread may release a shared job in between, so only a job
                # of one's own is sure to come back on the same backend.
                assert shared or again.id == held.id
                if rng.random() < 0.5:
                    mine.release(job)
                mine.release(job)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    def watcher() -> None:
        start.wait()
        while not stop.is_set():
            snapshot = pool.in_flight()
            if any(v < 0 for v in snapshot.values()):
                negative.append(snapshot)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(50)]
    watch = threading.Thread(target=watcher)
    for t in [*threads, watch]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    watch.join(timeout=10)
    assert not any(t.is_alive() for t in [*threads, watch])
    assert errors == []
    assert negative == []
    assert pool.in_flight() == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_concurrent_acquire_spreads_load(pool: BackendPool, redis_url: str) -> None:
    for name in ("a", "b", "c"):
        pool.register(spec(f"http://{name}:8000", id=name))
    start = threading.Barrier(30)

    def grab(n: int) -> None:
        client = redis.Redis.from_url(redis_url)
        try:
            start.wait()
            BackendPool(client).acquire(f"job-{n}")
        finally:
            client.close()

    threads = [threading.Thread(target=grab, args=(n,)) for n in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert pool.in_flight() == {"a": 10, "b": 10, "c": 10}


def test_route_checks_the_job_and_lets_go_once_it_ended(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    pool.register(spec("http://a:8000", id="a"))
    redis_client.hset("rs:job:j1", "status", "run")
    final = ("cancelled", "completed")
    assert pool.route("j1", "rs:job:j1", final).backend_id == "a"
    assert pool.in_flight() == {"a": 1}
    redis_client.hset("rs:job:j1", "status", "cancelled")
    with pytest.raises(JobEnded):
        pool.route("j1", "rs:job:j1", final)
    assert pool.in_flight() == {"a": 0} and pool.backend_of("j1") is None
    with pytest.raises(JobEnded):  # a record that is gone counts as ended
        pool.route("j2", "rs:job:j2", final)
    assert pool.in_flight() == {"a": 0}
