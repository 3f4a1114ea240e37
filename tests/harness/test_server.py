"""The HTTP app itself: keys, routes, limits, and errors always in the API's own shape."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest

from tests.harness.served import KEY, MODEL, FakeEndpoint, ServedApp
from workers.harness.server import key_fingerprint
from workers.harness.wire import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi."}]}
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    """A plain HTTP client, for what no SDK would send."""
    with httpx.Client(base_url=server) as client:
        yield client


@pytest.fixture
def socket_path() -> Iterator[str]:
    # Unix socket paths are short (108 bytes): not under pytest's long temporary paths.
    with tempfile.TemporaryDirectory(prefix="harness-", dir="/tmp") as directory:
        yield os.path.join(directory, "endpoint.sock")


def test_a_wrong_key_is_an_authentication_error(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with client, pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(**CHAT)
    assert caught.value.type == "authentication_error"


def test_a_request_without_a_key_is_refused(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"


def test_the_key_is_also_taken_from_x_api_key(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY})
    assert answer.status_code == 200
    assert answer.json()["object"] == "chat.completion"


def test_a_body_that_is_not_json_is_a_bad_request_in_openai_shape(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", content=b"{not json", headers=BEARER)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in answer.json()["error"]["message"]


def test_a_body_that_is_not_json_on_messages_is_in_anthropic_shape(http: httpx.Client) -> None:
    answer = http.post("/v1/messages", content=b"[1,", headers={"x-api-key": KEY})
    assert answer.status_code == 400
    assert answer.json() == {"type": "error", "error": answer.json()["error"]}
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_nan_is_not_json(http: httpx.Client) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi."}], "temperature": NaN}'
    answer = http.post("/v1/chat/completions", content=body, headers=BEARER)
    assert answer.status_code == 400


def test_a_body_over_the_limit_is_refused_with_413(
    endpoint: FakeEndpoint, serve: Callable[..., AbstractContextManager[ServedApp]]
) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    with serve(endpoint, max_body=4096) as served, httpx.Client(base_url=served.url) as http:
        openai_answer = http.post("/v1/chat/completions", json=big, headers=BEARER)
        anthropic_answer = http.post("/v1/messages", json=big, headers={"x-api-key": KEY})
    assert openai_answer.status_code == 413
    assert openai_answer.json()["error"]["type"] == "invalid_request_error"
    assert anthropic_answer.status_code == 413
    assert anthropic_answer.json()["error"]["type"] == "request_too_large"
    assert endpoint.requests == []


def test_an_unknown_route_is_a_404_in_the_api_shape(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json=CHAT, headers=BEARER)
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "not_found_error"
    anthropic_answer = http.get("/v1/files", headers={"anthropic-version": "2023-06-01"})
    assert anthropic_answer.json()["type"] == "error"


def test_a_wrong_method_is_a_405_in_the_api_shape(http: httpx.Client) -> None:
    answer = http.get("/v1/chat/completions", headers=BEARER)
    assert answer.status_code == 405
    assert "GET" in answer.json()["error"]["message"]


def test_an_endpoint_crash_is_a_502_without_its_traceback(
    http: httpx.Client, endpoint: FakeEndpoint, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint.will_fail(RuntimeError("internal detail"))
    with caplog.at_level(logging.ERROR, logger="workers.harness.server"):
        answer = http.post("/v1/chat/completions", json=CHAT, headers=BEARER)
    assert answer.status_code == 502
    assert answer.json()["error"]["type"] == "server_error"
    assert "internal detail" not in answer.text and "Traceback" not in answer.text
    assert "internal detail" in caplog.text  # the operator still sees it


def test_a_cancelled_job_is_final_for_the_sdk(server: str, endpoint: FakeEndpoint) -> None:
    endpoint.will_fail(ApiError("cancelled", "the job cannot go on: cancelled"))
    endpoint.will_answer()  # what a retry would get
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)  # the SDK's default retries
    with client, pytest.raises(openai.ConflictError):
        client.chat.completions.create(**CHAT)
    assert len(endpoint.requests) == 1


def test_models_lists_the_one_model_to_both_sdks(
    openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic
) -> None:
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    assert [m.id for m in anthropic_client.models.list()] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_the_sdks_talk_over_a_unix_socket(
    endpoint: FakeEndpoint,
    serve: Callable[..., AbstractContextManager[ServedApp]],
    socket_path: str,
) -> None:
    endpoint.will_answer(content="Over the socket.")
    with serve(endpoint, unix_path=socket_path) as served:
        transport = httpx2.HTTPTransport(uds=socket_path)
        http_client = httpx2.Client(transport=transport)
        client = openai.OpenAI(
            base_url=f"{served.url}/v1", api_key=KEY, http_client=http_client, max_retries=0
        )
        with client:
            completion = client.chat.completions.create(**CHAT)
    assert completion.choices[0].message.content == "Over the socket."


def test_stopping_the_server_removes_its_socket_file(
    endpoint: FakeEndpoint,
    serve: Callable[..., AbstractContextManager[ServedApp]],
    socket_path: str,
) -> None:
    with serve(endpoint, unix_path=socket_path):
        assert Path(socket_path).is_socket()
    assert not Path(socket_path).exists()


def test_the_key_is_never_logged(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "sk-a-wrong-key-that-must-not-be-logged"
    with caplog.at_level(logging.DEBUG):
        http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {wrong}"})
        http.post("/v1/chat/completions", json=CHAT, headers=BEARER)
    assert wrong not in caplog.text and KEY not in caplog.text
    assert key_fingerprint(wrong) in caplog.text
