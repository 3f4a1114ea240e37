"""Fixtures of the end-to-end tests: the one stack fixture and a client of it.

A module says how its stack differs with `stack_settings(request, data_dir)`, returning the
keyword arguments of `tests.support.stack.start_stack` (script, workers, settings)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.client import RolloutClient
from deploy.stack import Stack
from tests.support.stack import start_stack


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    """A whole stack for the module, started as its `stack_settings` says; stopped after."""
    data = tmp_path_factory.mktemp("stack")
    running = start_stack(data, tiny_model_dir, **request.module.stack_settings(request, data))
    yield running
    running.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[RolloutClient]:
    with RolloutClient(stack.gateway_url, timeout=60) as c:
        yield c
