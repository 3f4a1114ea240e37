"""A full or unreachable Redis gets a clear 503 from the gateway, not a 500, and nothing
half-written."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from api.app import create_app
from broker.embedded import EmbeddedRedis
from broker.jobstore import JobStore
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, serve, snapshot


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of this test's own: it is filled up or stopped."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


def fill_up(client: redis.Redis) -> None:
    """Cap Redis just above what it holds, then write until it refuses even a tiny value (a
    refused big value's request buffer counted too, and is freed)."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 2 * 1024 * 1024)
    keys = itertools.count()
    for size in (256 * 1024, 16 * 1024, 1024, 64, 1):
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            while True:  # ends: at most 2 MB more fits
                client.set(f"filler:{next(keys)}", b"x" * size)


def test_a_full_job_store_is_a_503_saying_so_and_keeps_nothing(
    own_redis: EmbeddedRedis,
) -> None:
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    store = JobStore(client, Settings().key_prefix)
    with (
        serve(create_app(Settings(redis_url=own_redis.url))) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        answer = http.post(
            "/v1/backends?verify=false",
            json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
        )
        assert answer.status_code == 201, answer.text
        accepted = http.post("/v1/rollouts", json={"task": GOOD_TASK})
        assert accepted.status_code == 202, accepted.text
        fill_up(client)
        before = snapshot(client)
        counts = store.status_counts()

        for path, body in [
            ("/v1/rollouts", {"task": GOOD_TASK}),
            ("/v1/batches", {"tasks": [GOOD_TASK, GOOD_TASK], "group_size": 4}),
        ]:
            answer = http.post(path, json=body)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["detail"].startswith("the job store is full: "), answer.text
            assert "maxmemory" in answer.json()["detail"]

        assert store.status_counts() == counts
        assert http.get("/readyz").json()["missing"][0].startswith("room in Redis")
        assert snapshot(client) == before
        # Reads still work, and so does everything once memory is freed.
        job = http.get(f"/v1/rollouts/{accepted.json()['job_id']}")
        assert job.status_code == 200, job.text
        client.delete(*client.keys("filler:*"))
        assert http.post("/v1/rollouts", json={"task": GOOD_TASK}).status_code == 202
    client.close()


def test_an_unreachable_redis_is_a_503_naming_it(own_redis: EmbeddedRedis) -> None:
    with (
        serve(create_app(Settings(redis_url=own_redis.url))) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        own_redis.stop()
        answer = http.get("/v1/rollouts/0123456789abcdef0123456789abcdef")
        assert answer.status_code == 503, answer.text
        assert "Redis" in answer.json()["detail"] and "unreachable" in answer.json()["detail"]
        assert http.get("/healthz").status_code == 503
