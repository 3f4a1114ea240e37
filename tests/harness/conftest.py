"""Fixtures: a served endpoint over a fake (`tests.harness.served`) and the official SDKs'
clients pointed at it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import anthropic
import openai
import pytest

from tests.harness.served import KEY, FakeEndpoint, ServedApp
from workers.harness.server import DEFAULT_MAX_BODY_BYTES
from workers.harness.wire import ApiError


@pytest.fixture
def endpoint() -> FakeEndpoint:
    return FakeEndpoint()


@pytest.fixture
def serve() -> Callable[..., AbstractContextManager[ServedApp]]:
    """Start a server over an endpoint (`unix_path`, `max_body` as wanted); it is stopped when
    its `with` block ends."""

    @contextmanager
    def running(
        endpoint: FakeEndpoint,
        *,
        unix_path: str | None = None,
        max_body: int = DEFAULT_MAX_BODY_BYTES,
    ) -> Iterator[ServedApp]:
        served = ServedApp(endpoint, unix_path=unix_path, max_body=max_body)
        served.start()
        try:
            yield served
        finally:
            served.stop()

    return running


@pytest.fixture
def server(
    endpoint: FakeEndpoint, serve: Callable[..., AbstractContextManager[ServedApp]]
) -> Iterator[str]:
    """The base URL (without `/v1`) of a server over `endpoint` on a free loopback port."""
    with serve(endpoint) as served:
        yield served.url


@pytest.fixture
def openai_client(server: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    yield client
    client.close()


@pytest.fixture
def anthropic_client(server: str) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)
    yield client
    client.close()


@pytest.fixture
def budget_spent() -> ApiError:
    return ApiError("budget", "the job's 8 model calls (agent.max_turns) are spent")
