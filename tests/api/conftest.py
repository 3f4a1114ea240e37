"""Fixtures of the gateway tests: one real gateway over HTTP on the test's Redis, no workers.

A module sets `GATEWAY_SETTINGS` (a dict of `Settings` fields) to start it otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from api.app import build_services, create_app
from api.service import Services
from core.schemas import BackendSpec
from core.settings import Settings
from tests.support.gateway import serve


@pytest.fixture
def gateway(redis_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """Base URL of a gateway on the test's Redis, with the module's `GATEWAY_SETTINGS`."""
    settings = getattr(request.module, "GATEWAY_SETTINGS", {})
    with serve(create_app(Settings(redis_url=redis_url, **settings))) as url:
        yield url


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


@pytest.fixture
def with_backend(http: httpx.Client) -> None:
    """A backend `b0` registered (not verified: nothing listens at its URL)."""
    answer = http.post(
        "/v1/backends?verify=false", json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"}
    )
    assert answer.status_code == 201, answer.text


@pytest.fixture
def svc(redis_url: str) -> Iterator[Services]:
    """The gateway's services (`build_services`) on the test's Redis, one backend `b`
    registered that nothing serves; a module may define its own `svc` instead."""
    services = build_services(Settings(redis_url=redis_url, node_name="gateway"))
    services.pool.register(BackendSpec(url="http://b.invalid:8000", model="m", id="b"))
    yield services
    services.celery.close()
    services.store.r.close()
