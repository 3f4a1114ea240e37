"""Who may use the console and what it refuses: sign-in, bearer tokens, cross-site posts,
unknown ids, malformed query parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from broker.jobstore import JobSpec

MakeBatch = Callable[[int, int], tuple[str, list[JobSpec]]]
TOKEN = "s3cret-console-token"


@pytest.fixture
def console_settings() -> dict[str, Any]:
    return {"api_token": TOKEN}


def test_without_a_token_the_console_answers_the_sign_in_form(app_client: TestClient) -> None:
    page = app_client.get("/ui/batches")
    assert page.status_code == 401
    assert 'action="/ui/signin"' in page.text


def test_a_bearer_token_opens_the_console(app_client: TestClient) -> None:
    page = app_client.get("/ui/batches", headers={"Authorization": f"Bearer {TOKEN}"})
    assert page.status_code == 200


def test_sign_in_sets_a_strict_http_only_cookie(app_client: TestClient) -> None:
    wrong = app_client.post("/ui/signin", data={"token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401
    answer = app_client.post("/ui/signin", data={"token": TOKEN}, follow_redirects=False)
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"]
    assert "rollserve_token=" in cookie and "HttpOnly" in cookie
    assert "samesite=strict" in cookie.lower()
    assert app_client.get("/ui/batches").status_code == 200


def test_the_cookie_does_not_open_the_api(app_client: TestClient) -> None:
    app_client.post("/ui/signin", data={"token": TOKEN})
    assert app_client.get("/v1/stats").status_code == 401


def test_a_post_without_the_csrf_token_is_refused(
    app_client: TestClient, make_batch: MakeBatch
) -> None:
    batch_id, _ = make_batch(1, 1)
    app_client.post("/ui/signin", data={"token": TOKEN})
    app_client.get(f"/ui/batches/{batch_id}")  # hands out the CSRF cookie
    refused = app_client.post(f"/ui/batches/{batch_id}/cancel", data={"csrf": "forged"})
    assert refused.status_code == 403
    assert app_client.get(f"/v1/batches/{batch_id}", headers=_bearer()).json()["counts"] == {
        "pending": 1
    }


def test_a_post_from_another_origin_is_refused(
    app_client: TestClient, make_batch: MakeBatch
) -> None:
    batch_id, _ = make_batch(1, 1)
    app_client.post("/ui/signin", data={"token": TOKEN})
    app_client.get(f"/ui/batches/{batch_id}")
    csrf = app_client.cookies["rollserve_csrf"]
    refused = app_client.post(
        f"/ui/batches/{batch_id}/cancel",
        data={"csrf": csrf},
        headers={"Origin": "http://evil.example"},
    )
    assert refused.status_code == 403


def test_cancel_from_the_console_cancels_the_batch(
    app_client: TestClient, make_batch: MakeBatch
) -> None:
    batch_id, _ = make_batch(1, 2)
    app_client.post("/ui/signin", data={"token": TOKEN})
    app_client.get(f"/ui/batches/{batch_id}")
    csrf = app_client.cookies["rollserve_csrf"]
    answer = app_client.post(
        f"/ui/batches/{batch_id}/cancel",
        data={"csrf": csrf},
        headers={"Origin": "http://testserver"},
        follow_redirects=False,
    )
    assert answer.status_code == 303
    counts = app_client.get(f"/v1/batches/{batch_id}", headers=_bearer()).json()["counts"]
    assert counts.get("cancelled") == 2


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "path",
    [
        "/ui/batches/" + "0" * 32,
        "/ui/batches/not-an-id",
        "/ui/batches/" + "0" * 32 + "/jobs",
        "/ui/rollouts/" + "0" * 32,
        "/ui/rollouts/x:jobs",
        "/ui/rollouts/" + "0" * 32 + "/tokens",
        "/ui/backends/nobody/engine",
    ],
)
def test_unknown_ids_are_404(app_client: TestClient, path: str) -> None:
    answer = app_client.get(path, headers=_bearer())
    assert answer.status_code == 404
    assert "Not found" in answer.text


@pytest.mark.parametrize(
    "query",
    ["?page=0", "?page=abc", "?page=-1", "?status=bogus", "?page=99999999999999"],
)
def test_malformed_query_parameters_are_422(
    app_client: TestClient, make_batch: MakeBatch, query: str
) -> None:
    batch_id, _ = make_batch(1, 1)
    answer = app_client.get(f"/ui/batches/{batch_id}{query}", headers=_bearer())
    assert answer.status_code == 422, answer.text
    assert "page" in answer.text or "status" in answer.text
