"""A job's routed policy against a real Redis pool, with in-process stand-in clients: failover
when a backend is lost, waiting out a drain, aborting the request of a cancelled job."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from core.schemas import Backend, BackendSpec
from routing.chat import ChatTemplater
from routing.pool import BackendPool, NoHealthyBackendError
from routing.protocol import Completion
from routing.vllm import BackendError
from workers.routed_policy import JobCancelled, RoutedPolicy, cache_salt


class FakeClient:
    """Answers `complete` after `delay` seconds, or fails as told; records every call."""

    def __init__(self, name: str, *, lost: bool = False, delay: float = 0.0) -> None:
        self.name = name
        self.lost = lost
        self.delay = delay
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.cancelled = 0

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        self.calls.append({"prompt_ids": prompt_ids, **params})
        if self.lost:
            raise BackendError("ConnectError: refused", url=f"http://{self.name}")
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Completion([1, 2], [-0.1, -0.2], self.name, "stop", None, len(prompt_ids))

    async def max_model_len(self) -> int:
        return 4096

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def register(pool: BackendPool, name: str, version: int | None = None) -> None:
    pool.register(
        BackendSpec(url=f"http://{name}:8000", model="m", id=name, policy_version=version)
    )


def routed(pool: BackendPool, clients: dict[str, FakeClient], **kwargs: Any) -> RoutedPolicy:
    def clients_of(backend: Backend) -> tuple[Any, ChatTemplater]:
        client = clients[backend.id]
        return client, ChatTemplater(client)  # type: ignore[arg-type]

    return RoutedPolicy(pool, "job-1", clients_of, **kwargs)


def test_requests_carry_the_salt_of_their_policy_version(pool: BackendPool) -> None:
    register(pool, "a", version=3)
    clients = {"a": FakeClient("a")}
    completion = asyncio.run(routed(pool, clients).complete([5, 6], max_tokens=4))
    call = clients["a"].calls[0]
    assert call["cache_salt"] == cache_salt(3) and call["cache_salt"] != cache_salt(4)
    assert call["request_id"] == "job-1-1" and call["max_tokens"] == 4
    assert completion.backend_id == "a" and completion.policy_version == 3
    assert cache_salt(None) is None


def test_a_lost_backend_is_marked_dead_and_the_request_resent(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    clients = {"a": FakeClient("a", lost=True), "b": FakeClient("b")}
    policy = routed(pool, clients)
    completion = asyncio.run(policy.complete([7, 8, 9], max_tokens=2))
    assert completion.backend_id == "b" and completion.text == "b"
    # The same prompt went to b: the turn is not lost.
    assert clients["b"].calls[0]["prompt_ids"] == [7, 8, 9]
    assert pool.get("a").state == "dead"  # type: ignore[union-attr]
    assert pool.in_flight() == {"a": 0, "b": 1} and policy.moves == 1


def test_failovers_are_bounded(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    clients = {"a": FakeClient("a", lost=True), "b": FakeClient("b", lost=True)}
    with pytest.raises(BackendError, match="refused"):
        asyncio.run(routed(pool, clients, failovers=1).complete([1], max_tokens=2))


class Answering(FakeClient):
    """Answers every request with an HTTP error."""

    def __init__(self, name: str, status: int) -> None:
        super().__init__(name)
        self.status = status

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        self.calls.append({"prompt_ids": prompt_ids, **params})
        raise BackendError("engine says no", status=self.status)


def test_a_refused_request_is_not_a_lost_backend(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    clients = {"a": Answering("a", 400), "b": FakeClient("b")}
    with pytest.raises(BackendError, match="says no"):
        asyncio.run(routed(pool, clients).complete([1], max_tokens=2))
    assert pool.get("a").state == "healthy"  # type: ignore[union-attr]
    assert clients["b"].calls == []


def test_a_backend_still_failing_with_5xx_is_left_for_another(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    clients = {"a": Answering("a", 500), "b": FakeClient("b")}
    assert asyncio.run(routed(pool, clients).complete([1], max_tokens=2)).backend_id == "b"
    assert pool.get("a").state == "dead"  # type: ignore[union-attr]


def test_a_job_waits_out_a_drain_and_goes_on_after_resume(pool: BackendPool) -> None:
    register(pool, "a")
    clients = {"a": FakeClient("a")}
    policy = routed(pool, clients)

    async def scenario() -> Completion:
        await policy.complete([1], max_tokens=2)
        pool.drain("a")
        second = asyncio.ensure_future(policy.complete([1, 1, 2], max_tokens=2))
        await asyncio.sleep(0.3)
        assert not second.done() and len(clients["a"].calls) == 1  # waiting, nothing sent
        pool.resume("a", policy_version=8)
        return await second

    completion = asyncio.run(scenario())
    assert completion.policy_version == 8 and len(clients["a"].calls) == 2


def test_waiting_for_a_backend_is_bounded(pool: BackendPool) -> None:
    register(pool, "a")
    pool.drain("a")
    with pytest.raises(NoHealthyBackendError, match="ROLLSERVE_BACKEND_WAIT"):
        asyncio.run(
            routed(pool, {"a": FakeClient("a")}, backend_wait=0.2).complete([1], max_tokens=1)
        )


def test_a_drained_backend_is_given_up_after_the_running_request(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    clients = {"a": FakeClient("a", delay=0.3), "b": FakeClient("b")}
    policy = routed(pool, clients)

    async def scenario() -> None:
        running = asyncio.ensure_future(policy.complete([1], max_tokens=2))
        await asyncio.sleep(0.1)
        pool.drain("a")
        assert not pool.get("a").idle  # type: ignore[union-attr]
        assert (await running).backend_id == "a"  # the running request finishes there
        assert pool.get("a").idle  # type: ignore[union-attr]
        assert (await policy.complete([1, 1, 2], max_tokens=2)).backend_id == "b"

    asyncio.run(scenario())


def test_a_cancelled_job_aborts_its_request(pool: BackendPool) -> None:
    register(pool, "a")
    clients = {"a": FakeClient("a", delay=30)}
    live = {"value": True}
    policy = routed(pool, clients, is_live=lambda: live["value"], poll=0.05)

    async def scenario() -> None:
        request = asyncio.ensure_future(policy.complete([1], max_tokens=2))
        await asyncio.sleep(0.2)
        live["value"] = False
        with pytest.raises(JobCancelled):
            await asyncio.wait_for(request, 5)

    asyncio.run(scenario())
    assert clients["a"].cancelled == 1 and clients["a"].aborted == ["job-1-1"]
    # Nothing more is sent for a job that is no longer live.
    with pytest.raises(JobCancelled):
        asyncio.run(policy.complete([1], max_tokens=2))
    assert len(clients["a"].calls) == 1


def test_a_sticky_job_sees_its_backends_new_policy_version(pool: BackendPool) -> None:
    register(pool, "a", version=3)
    clients = {"a": FakeClient("a")}
    policy = routed(pool, clients)

    async def scenario() -> list[int | None]:
        first = await policy.complete([1], max_tokens=2)
        pool.resume("a", policy_version=4)
        second = await policy.complete([1, 1, 2], max_tokens=2)
        return [first.policy_version, second.policy_version]

    assert asyncio.run(scenario()) == [3, 4]
    assert [c["cache_salt"] for c in clients["a"].calls] == [cache_salt(3), cache_salt(4)]


def test_routing_checks_the_jobs_record_in_the_same_round_trip(
    pool: BackendPool, redis_client: redis.Redis
) -> None:
    register(pool, "a")
    redis_client.hset("rs:job:job-1", "status", "run")
    clients = {"a": FakeClient("a")}
    policy = routed(
        pool, clients, is_live=lambda: False, job_key="rs:job:job-1", final=["cancelled"]
    )
    # is_live is not asked before a request when the record is checked while routing.
    assert asyncio.run(policy.complete([1], max_tokens=2)).backend_id == "a"
    redis_client.hset("rs:job:job-1", "status", "cancelled")
    with pytest.raises(JobCancelled):
        asyncio.run(policy.complete([1], max_tokens=2))
    assert len(clients["a"].calls) == 1 and pool.in_flight() == {"a": 0}


class Decoding(FakeClient):
    """Also decodes ids (its name and the ids), or fails to as told."""

    fail_decoding = False

    async def detokenize(self, ids: list[int]) -> str:
        if self.fail_decoding:
            raise BackendError("ConnectError: refused", url=f"http://{self.name}")
        return f"{self.name}:{ids}"


def test_decoding_asks_the_jobs_backend_without_routing_again(
    pool: BackendPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    register(pool, "a")
    clients: dict[str, FakeClient] = {"a": Decoding("a")}
    policy = routed(pool, clients)
    routes: list[str] = []
    route = pool.route
    monkeypatch.setattr(pool, "route", lambda *a, **k: routes.append("route") or route(*a, **k))

    async def turn() -> str:
        await policy.complete([1], max_tokens=2)
        return await policy.detokenize([5])

    assert asyncio.run(turn()) == "a:[5]"
    assert routes == ["route"]  # the request's only


def test_decoding_on_a_backend_that_fails_routes_as_a_request_does(pool: BackendPool) -> None:
    register(pool, "a")
    register(pool, "b")
    a, b = Decoding("a"), Decoding("b")
    policy = routed(pool, {"a": a, "b": b})

    async def turn() -> str:
        await policy.complete([1], max_tokens=2)
        a.fail_decoding = True
        return await policy.detokenize([5])

    assert asyncio.run(turn()) == "b:[5]"
    assert pool.get("a").state == "dead"  # type: ignore[union-attr]
