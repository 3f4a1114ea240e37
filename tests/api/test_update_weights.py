"""`POST /v1/backends/update_weights` and the clients' `update_weights`: drain, load, resume
with the policy version, against a real gateway and a development server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from api.client import AsyncRolloutClient, RolloutClient, RolloutServiceError
from routing.pool import BackendPool
from tests.support.devserver import DevBackend
from tests.support.weights import WeightDirs

UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture
def server(
    devserver_factory: Callable[..., DevBackend], weight_dirs: WeightDirs
) -> Iterator[DevBackend]:
    """The development server of the weight tests, given back with its first weights."""
    backend = devserver_factory("weights", args=["--max-model-len", "2048"])
    yield backend
    httpx.post(f"{backend.url}/resume", timeout=30)
    answer = httpx.post(
        f"{backend.url}/update_weights_from_disk",
        json={"model_path": str(weight_dirs.original)},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text


def register(http: httpx.Client, url: str, model: str, backend_id: str, **extra: Any) -> None:
    verify = "false" if url == UNREACHABLE else "true"
    answer = http.post(
        f"/v1/backends?verify={verify}",
        json={"url": url, "model": model, "id": backend_id, **extra},
    )
    assert answer.status_code == 201, answer.text


def served_path(server: DevBackend) -> str:
    return str(httpx.get(f"{server.url}/model_info", timeout=30).json()["model_path"])


def test_every_backend_is_drained_loaded_and_resumed_with_the_version(
    http: httpx.Client, gateway: str, server: DevBackend, weight_dirs: WeightDirs
) -> None:
    register(http, server.url, server.model, "dev", policy_version=1)
    with RolloutClient(gateway, timeout=60) as client:
        report = client.update_weights(str(weight_dirs.perturbed), policy_version=2)
    assert report.ok and report.error is None
    assert (report.model_path, report.policy_version) == (str(weight_dirs.perturbed), 2)
    [done] = report.backends
    assert done.id == "dev" and done.ok and done.error is None
    assert done.load_seconds is not None and done.load_seconds > 0
    assert done.total_seconds >= done.drain_seconds + done.load_seconds
    backend = http.get("/v1/backends/dev").json()
    assert (backend["state"], backend["policy_version"]) == ("healthy", 2)
    assert backend["weights_path"] == str(weight_dirs.perturbed)  # loaded again on a restart
    assert served_path(server) == str(weight_dirs.perturbed)
    # The async twin, naming the backend.
    again = asyncio.run(update_async(gateway, str(weight_dirs.perturbed_again), 3, ["dev"]))
    assert again.ok and [b.id for b in again.backends] == ["dev"]
    assert http.get("/v1/backends/dev").json()["policy_version"] == 3
    assert served_path(server) == str(weight_dirs.perturbed_again)


async def update_async(gateway: str, path: str, version: int, ids: list[str]) -> Any:
    async with AsyncRolloutClient(gateway, timeout=60) as client:
        return await client.update_weights(path, version, backends=ids, timeout=120)


def test_a_backend_that_fails_stays_drained_and_is_reported(
    http: httpx.Client, server: DevBackend, weight_dirs: WeightDirs
) -> None:
    register(http, server.url, server.model, "dev", policy_version=1)
    register(http, UNREACHABLE, "m", "gone", policy_version=1)
    answer = http.post(
        "/v1/backends/update_weights",
        json={"model_path": str(weight_dirs.perturbed), "policy_version": 2, "timeout": 30},
    )
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["ok"] is False and "gone" in report["error"]
    by_id = {b["id"]: b for b in report["backends"]}
    assert by_id["dev"]["ok"] and by_id["dev"]["error"] is None
    assert by_id["gone"]["ok"] is False and "POST /pause failed" in by_id["gone"]["error"]
    backends = {b["id"]: b for b in http.get("/v1/backends").json()}
    assert (backends["dev"]["state"], backends["dev"]["policy_version"]) == ("healthy", 2)
    assert (backends["gone"]["state"], backends["gone"]["policy_version"]) == ("draining", 1)


def test_when_no_backend_takes_the_weights_the_answer_is_502_and_they_stay_drained(
    http: httpx.Client, gateway: str, server: DevBackend, weight_dirs: WeightDirs
) -> None:
    register(http, server.url, server.model, "dev", policy_version=1)
    with RolloutClient(gateway, timeout=60) as client, pytest.raises(RolloutServiceError) as err:
        client.update_weights(str(weight_dirs.mismatched), policy_version=2)
    assert err.value.status_code == 502
    assert "no backend took the weights" in str(err.value) and "intermediate_size" in str(err.value)
    backend = http.get("/v1/backends/dev").json()
    assert (backend["state"], backend["policy_version"]) == ("draining", 1)
    assert served_path(server) == str(weight_dirs.original)


def test_a_backend_held_by_a_job_is_not_loaded_until_idle(
    http: httpx.Client, redis_client: redis.Redis, server: DevBackend, weight_dirs: WeightDirs
) -> None:
    register(http, server.url, server.model, "dev", policy_version=1)
    pool = BackendPool(redis_client)
    assert pool.acquire("job-1").id == "dev"
    body = {"model_path": str(weight_dirs.perturbed), "policy_version": 2, "timeout": 1.0}
    answer = http.post("/v1/backends/update_weights", json=body)
    assert answer.status_code == 502, answer.text
    assert "1 job(s) still held it" in answer.json()["detail"]
    assert served_path(server) == str(weight_dirs.original)  # not loaded under a running job
    assert http.get("/v1/backends/dev").json()["state"] == "draining"
    pool.release("job-1")
    # Idle now: the load itself may take more than a second on a loaded machine.
    answer = http.post("/v1/backends/update_weights", json={**body, "timeout": 60.0})
    assert answer.status_code == 200 and answer.json()["ok"], answer.text
    assert served_path(server) == str(weight_dirs.perturbed)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"policy_version": 2}, "model_path"),
        ({"model_path": "/m"}, "policy_version"),
        ({"model_path": "/m", "policy_version": -1}, "policy_version"),
        ({"model_path": "/m", "policy_version": "2"}, "policy_version"),
        ({"model_path": "", "policy_version": 2}, "model_path"),
        ({"model_path": "/m", "policy_version": 2, "timeout": 0}, "timeout"),
        ({"model_path": "/m", "policy_version": 2, "backends": []}, "backends"),
        ({"model_path": "/m", "policy_version": 2, "backends": ["a b"]}, "backends"),
        ({"model_path": "/m", "policy_version": 2, "weights": "x"}, "weights"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    http: httpx.Client, with_backend: None, body: dict[str, Any], where: str
) -> None:
    answer = http.post("/v1/backends/update_weights", json=body)
    assert answer.status_code == 422, answer.text
    assert where in {str(part) for item in answer.json()["detail"] for part in item["loc"]}
    assert http.get("/v1/backends/b0").json()["state"] == "healthy"  # nothing was drained


def test_unknown_backends_and_an_empty_fleet_are_refused_before_anything_is_drained(
    http: httpx.Client, with_backend: None
) -> None:
    body = {"model_path": "/m", "policy_version": 2, "backends": ["b0", "nope"]}
    answer = http.post("/v1/backends/update_weights", json=body)
    assert answer.status_code == 404 and "'nope'" in answer.json()["detail"]
    assert http.get("/v1/backends/b0").json()["state"] == "healthy"
    assert http.delete("/v1/backends/b0").status_code == 204
    answer = http.post(
        "/v1/backends/update_weights", json={"model_path": "/m", "policy_version": 2}
    )
    assert answer.status_code == 409 and "no backend is registered" in answer.json()["detail"]
