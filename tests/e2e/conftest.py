"""Fixtures of the end-to-end tests: the one stack fixture and a client of it.

A module says how its stack differs with `stack_settings(request, data_dir)`, returning the
keyword arguments of `tests.support.stack.start_stack` (script, workers, settings).

A module may run its tests against more than one kind of RUN worker with `RUN_POOLS`, a dict
from a name to the worker's `--jobs` (0: prefork; N: one process holding N jobs on one event
loop). Each test then runs once per pool (its id says `run=<name>`), on a stack of that pool
(module-scoped: one stack per pool). The first pool is the module's own tier; the others are
in the full tier. A test for one kind only says so with `@pytest.mark.run_pool("name", ...)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.client import RolloutClient
from deploy.stack import Stack
from tests.support.stack import start_stack


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    pools: dict[str, int] | None = getattr(metafunc.module, "RUN_POOLS", None)
    if not pools or "run_pool" not in metafunc.fixturenames:
        return
    only = metafunc.definition.get_closest_marker("run_pool")
    first = next(iter(pools))
    params = [
        pytest.param(jobs, id=f"run={name}", marks=() if name == first else pytest.mark.full)
        for name, jobs in pools.items()
        if only is None or name in only.args
    ]
    metafunc.parametrize("run_pool", params, scope="module")


@pytest.fixture(scope="module")
def run_pool() -> int:
    """The `--jobs` of the stack's RUN worker (0: prefork), when the module has one kind."""
    return 0


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    run_pool: int,
) -> Iterator[Stack]:
    """A whole stack for the module, started as its `stack_settings` says (with a RUN worker
    of `run_pool` jobs when that is not 0); stopped after."""
    data = tmp_path_factory.mktemp("stack")
    settings = request.module.stack_settings(request, data)
    if run_pool:
        settings["run_jobs"] = run_pool
    running = start_stack(data, tiny_model_dir, **settings)
    yield running
    running.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[RolloutClient]:
    with RolloutClient(stack.gateway_url, timeout=60) as c:
        yield c
