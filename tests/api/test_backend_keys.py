"""A backend that asks for an API key is registered with it: the gateway's check sends it,
a missing or wrong key is a 422 naming `api_key`, and the key is kept for the workers but
never shown back."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import redis

from routing.pool import BackendPool
from tests.support.devserver import SCRIPT, DevBackend
from tests.support.gateway import field_locs

KEY = "backend-key-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(devserver_factory: Callable[..., DevBackend]) -> DevBackend:
    return devserver_factory("keyed", script=SCRIPT, args=["--api-key", KEY])


@pytest.mark.parametrize("given", [None, "not-the-key-0123456789"], ids=["missing", "wrong"])
def test_a_missing_or_wrong_key_is_422_naming_api_key(
    http: httpx.Client, guarded: DevBackend, given: str | None
) -> None:
    body = {"url": guarded.url, "model": guarded.model}
    if given is not None:
        body["api_key"] = given
    answer = http.post("/v1/backends", json=body)
    assert answer.status_code == 422, answer.text
    assert field_locs(answer) == ["body.api_key"], answer.json()
    assert given is None or given not in answer.text
    assert http.get("/v1/backends").json() == []


def test_the_key_is_kept_for_the_workers_and_never_shown(
    http: httpx.Client, guarded: DevBackend, redis_url: str
) -> None:
    answer = http.post(
        "/v1/backends", json={"url": guarded.url, "model": guarded.model, "api_key": KEY, "id": "k"}
    )
    assert answer.status_code == 201, answer.text
    assert KEY not in answer.text and answer.json()["api_key_set"] is True
    listed = http.get("/v1/backends")
    assert KEY not in listed.text and listed.json()[0]["api_key_set"] is True
    assert KEY not in http.get("/v1/backends/k").text
    kept = BackendPool(redis.Redis.from_url(redis_url)).get("k")
    assert kept is not None and kept.api_key == KEY


@pytest.mark.parametrize("bad", ["short", "has space in it", "x" * 513, "tab\there-0123"])
def test_a_malformed_key_is_refused(http: httpx.Client, bad: str) -> None:
    answer = http.post(
        "/v1/backends?verify=false",
        json={"url": "http://127.0.0.1:9", "model": "m", "api_key": bad},
    )
    assert answer.status_code == 422 and field_locs(answer) == ["body.api_key"], answer.text
