"""Tenants are kept apart, and the fleet is the operator's: attacks of one tenant on another
and on the shared backends, through a real gateway over HTTP (no workers: jobs stay queued).

With two tenant tokens and the operator's, a tenant must not read, stream or cancel another
tenant's batch or rollouts (their ids answer 404, exactly as unknown ids do), must not see
them in its console, and must not register, replace, drain, resume or delete a backend or push
weights; `/metrics` needs a token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.app import create_app
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, serve

OPERATOR = "operator-s3cret"
ALICE = "alice-s3cret"
MALLORY = "mallory-s3cret"
UNKNOWN_BATCH = "0" * 32
UNKNOWN_JOB = "0" * 32


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def gateway(redis_url: str) -> Iterator[str]:
    settings = Settings(
        redis_url=redis_url,
        api_token=OPERATOR,
        tenant_tokens=f"alice:{ALICE},mallory:{MALLORY}",
    )
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
def operator(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30, headers=bearer(OPERATOR)) as client:
        yield client


@pytest.fixture
def alice(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30, headers=bearer(ALICE)) as client:
        yield client


@pytest.fixture
def mallory(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30, headers=bearer(MALLORY)) as client:
        yield client


BACKEND = {"url": "http://127.0.0.1:9", "model": "m", "id": "shared"}


@pytest.fixture
def shared_backend(operator: httpx.Client) -> None:
    answer = operator.post("/v1/backends?verify=false", json=BACKEND)
    assert answer.status_code == 201, answer.text


@pytest.fixture
def alices_batch(alice: httpx.Client, shared_backend: None) -> dict[str, Any]:
    answer = alice.post("/v1/batches", json={"tasks": [GOOD_TASK], "group_size": 2})
    assert answer.status_code == 202, answer.text
    accepted: dict[str, Any] = answer.json()
    return accepted


@pytest.fixture
def alices_rollout(alice: httpx.Client, shared_backend: None) -> str:
    answer = alice.post("/v1/rollouts", json={"task": GOOD_TASK})
    assert answer.status_code == 202, answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def unknown_answer(client: httpx.Client, method: str, path: str) -> tuple[int, str]:
    """The status and detail of `path` with the other tenant's id replaced by an unknown one."""
    answer = client.request(method, path)
    return answer.status_code, answer.json()["detail"]


def test_another_tenants_batch_answers_404_as_an_unknown_one(
    alice: httpx.Client, mallory: httpx.Client, alices_batch: dict[str, Any]
) -> None:
    batch_id = alices_batch["batch_id"]
    for method, template in [
        ("GET", "/v1/batches/{}"),
        ("GET", "/v1/batches/{}/results"),
        ("DELETE", "/v1/batches/{}?wait=0"),
    ]:
        stolen = mallory.request(method, template.format(batch_id))
        assert stolen.status_code == 404, (method, template, stolen.text)
        unknown = mallory.request(method, template.format(UNKNOWN_BATCH))
        assert stolen.json()["detail"] == unknown.json()["detail"].replace(UNKNOWN_BATCH, batch_id)
    # A cursor of the batch reveals nothing either: the 404 comes before it is read.
    cursor = mallory.get(f"/v1/batches/{batch_id}/results", params={"after": "1-0.00000000"})
    assert cursor.status_code == 404
    progress = alice.get(f"/v1/batches/{batch_id}").json()
    assert progress["counts"] == {"pending": 2}  # nothing was cancelled


def test_another_tenants_rollouts_answer_404(
    alice: httpx.Client,
    mallory: httpx.Client,
    alices_batch: dict[str, Any],
    alices_rollout: str,
) -> None:
    for job_id in [alices_rollout, *alices_batch["jobs"]]:
        for method in ("GET", "DELETE"):
            stolen = mallory.request(method, f"/v1/rollouts/{job_id}")
            assert stolen.status_code == 404, stolen.text
            unknown = mallory.request(method, f"/v1/rollouts/{UNKNOWN_JOB}")
            assert stolen.json()["detail"] == unknown.json()["detail"].replace(UNKNOWN_JOB, job_id)
        assert alice.get(f"/v1/rollouts/{job_id}").json()["status"] == "queued"


def test_a_tenant_still_reads_and_cancels_its_own_and_the_operator_sees_all(
    alice: httpx.Client,
    operator: httpx.Client,
    alices_batch: dict[str, Any],
    alices_rollout: str,
) -> None:
    batch_id = alices_batch["batch_id"]
    assert alice.get(f"/v1/batches/{batch_id}").status_code == 200
    assert operator.get(f"/v1/batches/{batch_id}").status_code == 200
    assert operator.get(f"/v1/rollouts/{alices_rollout}").status_code == 200
    cancelled = alice.delete(f"/v1/rollouts/{alices_rollout}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    done = alice.delete(f"/v1/batches/{batch_id}?wait=5")
    assert done.status_code == 200 and done.json()["counts"].get("cancelled") == 2


def test_a_tenants_console_lists_and_opens_only_its_own_batches(
    gateway: str, alices_batch: dict[str, Any], alice: httpx.Client
) -> None:
    batch_id = alices_batch["batch_id"]
    job_id = alices_batch["jobs"][0]
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        assert browser.post("/ui/signin", data={"token": MALLORY}).status_code in (200, 303)
        listing = browser.get("/ui/batches")
        assert listing.status_code == 200 and batch_id not in listing.text
        for path in (
            f"/ui/batches/{batch_id}",
            f"/ui/batches/{batch_id}/progress",
            f"/ui/batches/{batch_id}/jobs",
            f"/ui/rollouts/{job_id}",
            f"/ui/rollouts/{job_id}/turns",
            f"/ui/rollouts/{job_id}/tokens",
        ):
            page = browser.get(path)
            assert page.status_code == 404 and "Not found" in page.text, path
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        browser.post("/ui/signin", data={"token": ALICE})
        assert batch_id in browser.get("/ui/batches").text
        assert browser.get(f"/ui/batches/{batch_id}").status_code == 200
        assert browser.get(f"/ui/rollouts/{job_id}").status_code == 200


def test_a_tenants_console_shows_no_fleet_pages(gateway: str, shared_backend: None) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        browser.post("/ui/signin", data={"token": MALLORY})
        for path in ("/ui/fleet", "/ui/fleet/stats", "/ui/backends", "/ui/backends/shared/engine"):
            assert browser.get(path).status_code == 403, path
        assert 'href="/ui/fleet"' not in browser.get("/ui/batches").text
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        browser.post("/ui/signin", data={"token": OPERATOR})
        assert browser.get("/ui/backends").status_code == 200
        assert 'href="/ui/fleet"' in browser.get("/ui/batches").text


def test_a_tenant_cannot_repoint_drain_resume_or_delete_the_shared_backend(
    mallory: httpx.Client, operator: httpx.Client, shared_backend: None
) -> None:
    attacks = [
        ("POST", "/v1/backends?verify=false", {**BACKEND, "url": "http://127.0.0.1:7"}),
        ("POST", "/v1/backends?verify=false", {**BACKEND, "id": "mine"}),
        ("POST", "/v1/backends/drain", None),
        ("POST", "/v1/backends/shared/drain", None),
        ("POST", "/v1/backends/resume", {"policy_version": 999}),
        ("POST", "/v1/backends/shared/resume", {"policy_version": 999}),
        ("POST", "/v1/backends/update_weights", {"model_path": "/tmp/x", "policy_version": 9}),
        ("DELETE", "/v1/backends/shared", None),
    ]
    for method, path, body in attacks:
        answer = mallory.request(method, path, json=body)
        assert answer.status_code == 403, (method, path, answer.text)
        assert "ROLLSERVE_API_TOKEN" in answer.json()["detail"]
    backends = operator.get("/v1/backends").json()
    assert [(b["id"], b["url"], b["state"], b["policy_version"]) for b in backends] == [
        ("shared", BACKEND["url"], "healthy", None)
    ]


def test_the_operator_still_runs_the_fleet(operator: httpx.Client, shared_backend: None) -> None:
    assert operator.post("/v1/backends/shared/drain").json()["state"] == "draining"
    resumed = operator.post("/v1/backends/shared/resume", json={"policy_version": 3}).json()
    assert resumed["state"] == "healthy" and resumed["policy_version"] == 3
    assert operator.delete("/v1/backends/shared").status_code == 204


def test_metrics_need_a_token_when_tokens_are_set(gateway: str) -> None:
    assert httpx.get(f"{gateway}/metrics").status_code == 401
    assert httpx.get(f"{gateway}/metrics", headers=bearer("wrong")).status_code == 401
    assert httpx.get(f"{gateway}/metrics", headers=bearer(MALLORY)).status_code == 200
    assert httpx.get(f"{gateway}/healthz").status_code == 200
