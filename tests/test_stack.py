"""The one-machine stack launcher: idempotent start, clean stop."""

from __future__ import annotations

from pathlib import Path

import httpx

from broker.processes import free_port
from broker.settings import Settings
from deploy.stack import Stack, StackOptions
from tests.test_demo import processes_mentioning


def test_entering_a_started_stack_starts_nothing_twice(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", port=free_port())
    stack = Stack(settings, StackOptions(workers={}, dev_backend=None)).start()
    children, redis_url = dict(stack.children), stack.redis_url
    with stack as same:
        assert same is stack
        assert stack.children == children and stack.redis_url == redis_url
        assert httpx.get(f"{stack.gateway_url}/healthz").json()["redis"] is True
    assert processes_mentioning(str(tmp_path / "data")) == []
    stack.stop()  # a second stop is harmless
