"""A development server started with an API key asks for it on every route but its liveness
probes, as `rollserve up` starts it (`routing.devserver.guard`), and the inference clients
send it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from routing.vllm import BackendError
from tests.support.devserver import SCRIPT, DevBackend

KEY = "guard-test-key-0123456789"

GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/completions", {"model": "guarded", "prompt": [1, 2], "max_tokens": 1}),
    (
        "POST",
        "/inference/v1/generate",
        {"model": "guarded", "token_ids": [1], "sampling_params": {}},
    ),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {}}),
    ("POST", "/abort_request", {"rid": "x"}),
    # the weight-loading routes: unguarded, anything that reaches the port swaps the model
    ("POST", "/pause", None),
    ("POST", "/collective_rpc", {"method": "rollserve_load_weights", "args": ["/tmp"]}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ("POST", "/resume", None),
]


@pytest.fixture(scope="module")
def guarded(devserver_factory: Callable[..., DevBackend]) -> DevBackend:
    return devserver_factory("guarded", script=SCRIPT, args=["--api-key", KEY])


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[p for _, p, _ in GUARDED])
def test_every_route_asks_for_the_key(
    guarded: DevBackend, method: str, path: str, body: dict[str, object] | None
) -> None:
    url = guarded.url + path
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": KEY}):
        answer = httpx.request(method, url, json=body, headers=headers, timeout=10)
        assert answer.status_code == 401, (headers, answer.status_code, answer.text)


def test_the_liveness_probes_and_the_right_key_are_let_through(guarded: DevBackend) -> None:
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    answer = httpx.get(
        guarded.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "guarded"


async def test_a_client_with_the_key_is_served_and_one_without_is_refused(
    guarded: DevBackend,
) -> None:
    async with guarded.client(api_key=KEY, retries=0) as client:
        ids = await client.tokenize("hello")
        assert ids and await client.health()
        done = await client.complete(ids, max_tokens=4)
        assert done.output_ids
    async with guarded.client(retries=0) as client:
        with pytest.raises(BackendError) as refused:
            await client.tokenize("hello")
    assert refused.value.status == 401
