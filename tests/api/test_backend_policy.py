"""Backend registration policy over real HTTP: URLs only http(s) with a valid host, no
credentials (never echoed), an optional allow-list of networks, a registration check that
never echoes what the target served, the context length kept and enforced at submission,
and health sweeps that survive any single backend's bad data."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import redis

from api.app import create_app
from broker.processes import free_port
from core.schemas import BackendSpec
from core.settings import Settings
from routing.health import sweep
from routing.pool import BackendPool
from tests.support.gateway import GOOD_TASK, field_locs, serve, snapshot
from tests.support.stub import Answer, StubServer

SECRET = "s3cr3t-pw"
"""Appears in what fake servers send back or in credentials: never in any answer."""


class ModelsServer(StubServer):
    """A fake inference server: `GET /v1/models` answers `status`, `headers`, `body`
    (changeable while it runs); `GET /health` answers `health`."""

    def __init__(self) -> None:
        self.status = 200
        self.body: bytes = b""
        self.headers: dict[str, str] = {"Content-Type": "application/json"}
        self.health = 200
        super().__init__(self.answer)

    def answer(self, method: str, path: str) -> Answer:
        if path == "/health":
            return self.health, {}, b""
        if path != "/v1/models":
            return 404, {}, b""
        return self.status, self.headers, self.body

    def serve_models(self, cards: list[dict[str, Any]]) -> None:
        self.body = json.dumps({"object": "list", "data": cards}).encode()


@pytest.fixture
def models_server() -> Iterator[ModelsServer]:
    running = ModelsServer()
    yield running
    running.close()


@contextmanager
def gateway_client(redis_url: str, **settings: Any) -> Iterator[httpx.Client]:
    app = create_app(Settings(redis_url=redis_url, **settings))
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def register(client: httpx.Client, url: str, *, verify: bool = True, **extra: Any) -> Any:
    query = "" if verify else "?verify=false"
    return client.post(f"/v1/backends{query}", json={"url": url, "model": "m", **extra})


def assert_refused(answer: httpx.Response, loc: str, client: httpx.Client) -> None:
    assert answer.status_code == 422, answer.text
    assert field_locs(answer) == [loc], answer.json()
    assert client.get("/v1/backends").json() == []


# ----------------------------------------------------------------------------- URLs

BAD_URLS = [
    ("control character in the host", "http://a\u0001b:1"),
    ("non-ASCII host", "http://bücher.example:8000"),
    ("lone surrogate", "http://\udc80:1"),
    ("not http", "ftp://127.0.0.1:21"),
    ("no host", "http://:8000"),
    ("port out of range", "http://127.0.0.1:99999"),
    ("port 0", "http://127.0.0.1:0"),
    ("unclosed IPv6 bracket", "http://[::1:8000"),
    ("bad IPv4", "http://1.2.3.999:8000"),
    ("bad DNS name", "http://-gpu-:8000"),
    ("a label too long", "http://" + "a" * 70 + ":8000"),
    ("query", "http://127.0.0.1:8000?x=1"),
    ("fragment", "http://127.0.0.1:8000#x"),
    ("backslash in the path", "http://127.0.0.1:8000/a\\b"),
    ("bad percent escape", "http://127.0.0.1:8000/%zz"),
]


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize(("case", "url"), BAD_URLS, ids=[c[0] for c in BAD_URLS])
def test_bad_urls_are_422_naming_url_and_register_nothing(
    http: httpx.Client, redis_client: redis.Redis, case: str, url: str, verify: bool
) -> None:
    before = snapshot(redis_client)
    body = json.dumps({"url": url, "model": "m"}).encode()  # lone surrogates as \\u escapes
    query = "" if verify else "?verify=false"
    answer = http.post(
        f"/v1/backends{query}", content=body, headers={"content-type": "application/json"}
    )
    assert_refused(answer, "body.url", http)
    assert snapshot(redis_client) == before, case


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize(
    "url",
    [
        f"http://alice:{SECRET}@127.0.0.1:8000",
        f"http://alice:{SECRET}@127.0.0.1:8000/v1",
        f"https://{SECRET}@localhost",
        f"http://alice:{SECRET}@evil@127.0.0.1:8000",
        f"ftp://alice:{SECRET}@127.0.0.1",
        f"alice:{SECRET}@127.0.0.1:8000",
    ],
)
def test_credentials_in_the_url_are_refused_and_never_echoed(
    http: httpx.Client, caplog: pytest.LogCaptureFixture, url: str, verify: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    answer = register(http, url, verify=verify)
    assert_refused(answer, "body.url", http)
    assert SECRET not in answer.text and "alice" not in answer.text
    listed = http.get("/v1/backends")
    assert SECRET not in listed.text
    assert SECRET not in caplog.text


def test_a_valid_url_with_an_at_sign_in_its_path_is_kept_as_given(http: httpx.Client) -> None:
    answer = register(http, "http://127.0.0.1:9/models/a@b", verify=False)
    assert answer.status_code == 201, answer.text
    assert answer.json()["url"] == "http://127.0.0.1:9/models/a@b"


# ----------------------------------------------------------------------------- addresses


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_host_that_does_not_resolve_is_422(http: httpx.Client, verify: bool) -> None:
    answer = register(http, "http://no-such-host.invalid:8000", verify=verify)
    assert_refused(answer, "body.url", http)
    assert "does not resolve" in answer.text


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest",
        "http://169.254.1.2:8000",
        "http://[::ffff:169.254.169.254]:80",
        "http://[fe80::1]:8000",
        "http://[fd00:ec2::254]:80",
        "http://100.100.100.200:80",
    ],
)
def test_link_local_and_metadata_addresses_are_refused_by_default(
    http: httpx.Client, url: str
) -> None:
    answer = register(http, url, verify=False)
    assert_refused(answer, "body.url", http)
    assert "ROLLSERVE_BACKEND_NETWORKS" in answer.text


def test_the_allow_list_refuses_and_permits(redis_url: str, models_server: ModelsServer) -> None:
    models_server.serve_models([{"id": "m", "max_model_len": 4096}])
    with gateway_client(redis_url, backend_networks="10.0.0.0/8") as client:
        outside = register(client, models_server.url)
        assert_refused(outside, "body.url", client)
        assert "outside" in outside.text
        assert_refused(register(client, "http://localhost:8000", verify=False), "body.url", client)
    with gateway_client(redis_url, backend_networks="10.0.0.0/8, 127.0.0.0/8") as client:
        assert register(client, models_server.url).status_code == 201
        by_name = register(client, "http://localhost:9", verify=False, id="by-name")
        assert by_name.status_code == 201, by_name.text
        metadata = register(client, "http://169.254.169.254", verify=False)
        assert metadata.status_code == 422 and field_locs(metadata) == ["body.url"]
        assert [b["id"] for b in client.get("/v1/backends").json()] == [
            "127.0.0.1-" + models_server.url.rsplit(":", 1)[1],
            "by-name",
        ]


def test_link_local_is_admitted_only_when_listed_within_its_range(redis_url: str) -> None:
    metadata = "http://169.254.169.254:80"
    with gateway_client(redis_url, backend_networks="0.0.0.0/0,::/0") as client:
        assert register(client, metadata, verify=False).status_code == 422
        assert register(client, "http://127.0.0.1:9", verify=False).status_code == 201
    with gateway_client(redis_url, backend_networks="169.254.169.254/32") as client:
        assert register(client, metadata, verify=False, id="md").status_code == 201
    with gateway_client(redis_url, backend_networks="169.254.0.0/16") as client:
        assert register(client, "http://169.254.7.7:80", verify=False).status_code == 201


def test_a_bad_allow_list_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="CIDR"):
        Settings(backend_networks="10.0.0.0/8,not-a-network")


# ----------------------------------------------------------------------------- /v1/models


def bad_answers() -> list[tuple[str, int, dict[str, str], bytes]]:
    json_type = {"Content-Type": "application/json"}
    listed = json.dumps([{"id": SECRET}]).encode()
    return [
        ("a list", 200, json_type, listed),
        ("data a string", 200, json_type, json.dumps({"data": SECRET}).encode()),
        ("data of numbers", 200, json_type, b'{"data": [1]}'),
        ("data null", 200, json_type, b'{"data": null, "x": "' + SECRET.encode() + b'"}'),
        ("ids not strings", 200, json_type, b'{"data": [{"id": 7}]}'),
        ("not JSON", 200, {"Content-Type": "text/html"}, f"<h1>{SECRET}</h1>".encode()),
        ("not UTF-8", 200, json_type, b"\xff\xfe" + SECRET.encode()),
        ("deep nesting", 200, json_type, b"[" * 200_000 + b"]" * 200_000),
        ("huge", 200, json_type, b'{"data": [], "pad": "' + b"x" * 3_000_000 + b'"}'),
        ("server error", 500, json_type, json.dumps({"error": SECRET}).encode()),
        ("redirect", 302, {"Location": "http://169.254.169.254/"}, SECRET.encode()),
        (
            "compressed",
            200,
            {**json_type, "Content-Encoding": "gzip"},
            gzip.compress(json.dumps({"data": [{"id": "m"}]}).encode()),
        ),
    ]


BAD_ANSWERS = bad_answers()


@pytest.mark.parametrize(
    ("case", "status", "headers", "body"), BAD_ANSWERS, ids=[c[0] for c in BAD_ANSWERS]
)
def test_a_server_that_does_not_answer_like_openai_is_422_without_echo(
    http: httpx.Client,
    redis_client: redis.Redis,
    models_server: ModelsServer,
    case: str,
    status: int,
    headers: dict[str, str],
    body: bytes,
) -> None:
    models_server.status, models_server.headers, models_server.body = status, headers, body
    before = snapshot(redis_client)
    answer = register(http, models_server.url)
    assert_refused(answer, "body.url", http)
    assert SECRET not in answer.text, case
    assert len(answer.content) < 2000
    if status == 200:
        assert "does not answer like an OpenAI-compatible /v1/models" in answer.text
    assert snapshot(redis_client) == before


def test_a_model_not_served_is_named_without_listing_what_is(
    http: httpx.Client, models_server: ModelsServer
) -> None:
    models_server.serve_models([{"id": SECRET}, {"id": "other"}])
    answer = register(http, models_server.url)
    assert_refused(answer, "body.model", http)
    assert "'m'" in answer.text and SECRET not in answer.text and "other" not in answer.text
    models_server.serve_models([])
    assert_refused(register(http, models_server.url), "body.model", http)


def test_a_server_that_does_not_answer_is_refused_in_time(http: httpx.Client) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    answer = register(http, url)
    assert_refused(answer, "body.url", http)
    assert "could not be reached" in answer.text


# ----------------------------------------------------------------------------- context length


def test_the_context_length_is_kept_and_bounds_max_tokens_at_submission(
    http: httpx.Client, redis_client: redis.Redis, models_server: ModelsServer
) -> None:
    models_server.serve_models([{"id": "other"}, {"id": "m", "max_model_len": 2048}])
    created = register(http, models_server.url, id="small")
    assert created.status_code == 201, created.text
    assert created.json()["max_model_len"] == 2048
    assert http.get("/v1/backends/small").json()["max_model_len"] == 2048

    before = snapshot(redis_client)
    too_long = {"task": GOOD_TASK, "sampling": {"max_tokens": 2049}}
    answer = http.post("/v1/rollouts", json=too_long)
    assert answer.status_code == 422 and field_locs(answer) == ["body.sampling.max_tokens"]
    assert "2048" in answer.text
    batch = {"tasks": [GOOD_TASK], "group_size": 2, "sampling": {"max_tokens": 4096}}
    answer = http.post("/v1/batches", json=batch)
    assert answer.status_code == 422 and field_locs(answer) == ["body.sampling.max_tokens"]
    assert snapshot(redis_client) == before

    fits = http.post("/v1/rollouts", json={"task": GOOD_TASK, "sampling": {"max_tokens": 2048}})
    assert fits.status_code == 202, fits.text
    assert http.post("/v1/rollouts", json={"task": GOOD_TASK}).status_code == 202

    # The largest context among the backends is the bound.
    models_server.serve_models([{"id": "m", "max_model_len": 8192}])
    assert register(http, models_server.url, id="large").status_code == 201
    batch["sampling"] = {"max_tokens": 8192}
    assert http.post("/v1/batches", json=batch).status_code == 202
    batch["sampling"] = {"max_tokens": 8193}
    assert http.post("/v1/batches", json=batch).status_code == 422


def test_without_a_known_context_any_max_tokens_is_accepted(
    http: httpx.Client, models_server: ModelsServer
) -> None:
    models_server.serve_models([{"id": "m"}, {"id": "n", "max_model_len": "big"}])
    created = register(http, models_server.url, id="plain")
    assert created.status_code == 201 and created.json()["max_model_len"] is None
    unverified = register(http, "http://127.0.0.1:9", verify=False, id="unverified")
    assert unverified.status_code == 201 and unverified.json()["max_model_len"] is None
    huge = {"task": GOOD_TASK, "sampling": {"max_tokens": 1_000_000}}
    assert http.post("/v1/rollouts", json=huge).status_code == 202


def test_registering_again_replaces_the_context_length(
    http: httpx.Client, models_server: ModelsServer
) -> None:
    models_server.serve_models([{"id": "m", "max_model_len": 2048}])
    assert register(http, models_server.url, id="b").json()["max_model_len"] == 2048
    again = register(http, models_server.url, verify=False, id="b").json()
    assert again["max_model_len"] is None


# ----------------------------------------------------------------------------- health sweeps

UNUSABLE_URLS = [
    "http://a\u0001b:1",  # httpx.InvalidURL
    "http://" + "a" * 70 + ":1",  # UnicodeError from IDNA
    "http://[::1:1",  # httpx.InvalidURL (unclosed bracket)
    "http://bücher:1",  # not ASCII
]


def test_a_sweep_survives_backends_whose_url_httpx_refuses(
    redis_client: redis.Redis, models_server: ModelsServer
) -> None:
    pool = BackendPool(redis_client, failure_threshold=2)
    pool.register(BackendSpec(url=models_server.url, model="m", id="good"))
    for index, url in enumerate(UNUSABLE_URLS):
        # As a record written before URLs were checked would be: no validation.
        pool.register(BackendSpec.model_construct(url=url, model="m", id=f"bad{index}"))
    live = lambda jobs: set(jobs)  # noqa: E731

    first = sweep(pool, live)
    assert first.probed == 1 + len(UNUSABLE_URLS) and first.evicted == []
    second = sweep(pool, live)
    assert sorted(second.evicted) == [f"bad{i}" for i in range(len(UNUSABLE_URLS))]
    assert pool.get("good").state == "healthy"  # type: ignore[union-attr]
    assert pool.acquire("job").id == "good"

    models_server.health = 503
    sweep(pool, live)
    assert sweep(pool, live).evicted == ["good"]
    models_server.health = 200
    assert sweep(pool, live).readmitted == ["good"]


def test_a_sweep_survives_malformed_records(
    redis_client: redis.Redis, models_server: ModelsServer
) -> None:
    pool = BackendPool(redis_client, failure_threshold=2)
    pool.register(BackendSpec(url=models_server.url, model="m", id="good"))
    for name in ("no-url", "bad-capacity", "bad-kind", "bad-context"):
        pool.register(BackendSpec(url="http://127.0.0.1:9", model="m", id=name))
    redis_client.hdel(pool.backend_key("no-url"), "url")
    redis_client.hset(pool.backend_key("bad-capacity"), "capacity", "lots")
    redis_client.hset(pool.backend_key("bad-kind"), "kind", "tgi")
    redis_client.hset(pool.backend_key("bad-context"), "max_model_len", "long")
    live = lambda jobs: set(jobs)  # noqa: E731

    assert [b.id for b in pool.list()] == ["good"]  # the others are logged, not raised
    first = sweep(pool, live)
    assert first.probed == 5 and first.evicted == []
    second = sweep(pool, live)
    assert sorted(second.evicted) == ["bad-capacity", "bad-context", "bad-kind", "no-url"]
    assert pool.assignable() == 1 and pool.acquire("job").id == "good"

    models_server.health = 503
    sweep(pool, live)
    assert sweep(pool, live).evicted == ["good"]
    models_server.health = 200
    assert sweep(pool, live).readmitted == ["good"]


def test_a_check_that_raises_counts_as_failed_and_the_others_are_checked(
    redis_client: redis.Redis,
) -> None:
    pool = BackendPool(redis_client, failure_threshold=1)
    for name in ("a", "b", "c"):
        pool.register(BackendSpec(url="http://127.0.0.1:9", model="m", id=name))

    def check(backend: Any) -> bool:
        if backend.id == "b":
            raise RuntimeError("boom")
        return True

    report = sweep(pool, lambda jobs: set(jobs), check)
    assert report.probed == 3 and report.evicted == ["b"]
    assert [b.state for b in pool.list()] == ["healthy", "dead", "healthy"]


def test_the_listing_skips_a_malformed_record(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    assert register(http, "http://127.0.0.1:9", verify=False, id="ok").status_code == 201
    assert register(http, "http://127.0.0.1:10", verify=False, id="broken").status_code == 201
    redis_client.hset("rs:pool:backend:broken", "capacity", "lots")
    listed = http.get("/v1/backends")
    assert listed.status_code == 200 and [b["id"] for b in listed.json()] == ["ok"]
