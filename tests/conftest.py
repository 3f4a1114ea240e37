"""Shared fixtures: a real embedded Redis per test session, a clean database per test, the tiny
model and its tokenizer, a backend pool. The development server, sandbox, tool server and vLLM
fixtures of `tests/support/` are loaded as plugins."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.embedded import EmbeddedRedis
from routing.pool import BackendPool

pytest_plugins = [
    "tests.support.devserver",
    "tests.support.tiers",
    "tests.support.require",
    "tests.support.sandbox",
    "tests.support.toolserver",
    "tests.support.vllm",
    "tests.support.weights",
]

os.environ.setdefault("TIKTOKEN_CACHE_DIR", "")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """torch in a test process computes on one thread: the suite runs several test processes
    and stacks at once on a few cores, where torch's idle threads spin on CPU others need."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def session_sandbox_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Boxes of the stacks that name no directory of their own go under this session's (this
    xdist worker's) temporary directory, not the checkout's `.rollserve/sandboxes`: stacks of
    other workers (other Redis) run beside them, and a reaper takes a box whose job its own
    Redis does not know, in a directory both share, for an orphan."""
    if os.environ.get("ROLLSERVE_SANDBOX_DIR"):
        yield
        return
    os.environ["ROLLSERVE_SANDBOX_DIR"] = str(tmp_path_factory.mktemp("sandboxes"))
    yield
    os.environ.pop("ROLLSERVE_SANDBOX_DIR", None)


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """URL of an empty Redis database (flushed before and after the test)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def work_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3 with the real Qwen vocabulary, built once per test session."""
    from routing.devserver.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from routing.hf_tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def pool(redis_client: redis.Redis) -> BackendPool:
    """A backend pool on the test's empty Redis database."""
    return BackendPool(redis_client)
