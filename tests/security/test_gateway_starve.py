"""No client starves the gateway: with many `?wait=true` long-polls and idle results streams of
one tenant open against a real gateway, `/healthz` and a submission still answer.

Long waits used to hold a thread of the gateway's pool each (about 40 of them), so a client
with a few hundred open starved every other request. The bound here is generous (5 s, where an
answer takes milliseconds): the point is that the requests are served at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from api.app import create_app
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, serve

LONG_POLLS = 100
STREAMS = 50
BOUND_SECONDS = 5.0
TOKEN = "starver-s3cret"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def gateway(redis_url: str) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_url, api_token=TOKEN))) as url:
        answer = httpx.post(
            f"{url}/v1/backends?verify=false",
            json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
            headers=HEADERS,
        )
        assert answer.status_code == 201, answer.text
        yield url


async def hold_long_poll(client: httpx.AsyncClient) -> None:
    """A rollout submitted with wait=true: nothing runs it, so it waits out its timeout."""
    await client.post("/v1/rollouts?wait=true&timeout=20", json={"task": GOOD_TASK})


async def hold_stream(client: httpx.AsyncClient, batch_id: str) -> None:
    """The results stream of a batch nothing runs: keep-alive lines only, read forever."""
    async with client.stream("GET", f"/v1/batches/{batch_id}/results") as answer:
        async for _ in answer.aiter_lines():
            pass


async def seconds_to_answer(url: str, method: str, path: str, **kwargs: object) -> float:
    """Seconds a fresh client waits for the gateway's answer (the bound + 1 when none came)."""
    began = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_SECONDS + 1, headers=HEADERS) as c:
        try:
            answer = await c.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.TimeoutException:
            return BOUND_SECONDS + 1
    assert answer.status_code < 300, answer.text
    return time.monotonic() - began


async def starve(url: str) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=LONG_POLLS + STREAMS + 10)
    async with httpx.AsyncClient(
        base_url=url, timeout=60, limits=limits, headers=HEADERS
    ) as attacker:
        batch = await attacker.post("/v1/batches", json={"tasks": [GOOD_TASK]})
        batch_id = batch.json()["batch_id"]
        holders = [asyncio.create_task(hold_long_poll(attacker)) for _ in range(LONG_POLLS)]
        holders += [asyncio.create_task(hold_stream(attacker, batch_id)) for _ in range(STREAMS)]
        try:
            await asyncio.sleep(2.0)  # the attacker's requests reach the gateway and wait there
            health = [await seconds_to_answer(url, "GET", "/healthz") for _ in range(10)]
            submit = await seconds_to_answer(url, "POST", "/v1/rollouts", json={"task": GOOD_TASK})
            # the load was real: every request of the attacker was still held open
            assert [h for h in holders if h.done()] == []
        finally:
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    return health, submit


def test_open_long_polls_and_streams_do_not_starve_health_or_submissions(gateway: str) -> None:
    health, submit = asyncio.run(starve(gateway))
    assert max(health) < BOUND_SECONDS, health
    assert submit < BOUND_SECONDS
