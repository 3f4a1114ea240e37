"""A stack whose RUN queue has no worker of its own: the launchers under test bring them.

Redis, the development server (scripted: `FAST` answers at once, `SLOW` after a few
seconds), the gateway, and one INIT and one EVAL worker; the Slurm cluster fixture comes from
`tests/support/slurm.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.jobstore import JobStore
from deploy.stack import Stack
from tests.support.slurm import slurm_cluster  # noqa: F401  (the fixture, for test_slurm)
from tests.support.stack import start_stack

SLOW_SECONDS = 3.0
RELAXED_LIMITS = {"run_soft_time_limit": 60.0, "run_time_limit": 70.0, "visibility_timeout": 80.0}
SCRIPT: list[dict[str, Any]] = [
    {"match": "FAST", "samples": [["2+2 = \\boxed{4}"]]},
    {"match": "SLOW", "samples": [["2+2 = \\boxed{4}"]], "delay": SLOW_SECONDS},
]


@pytest.fixture(scope="package")
def runless_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    """One for all the tests here (each leaves its queues empty): a stack takes a while. It
    stops when they are done, and keeps its boxes in a directory of its own: its workers'
    reaper takes any box in theirs whose job its Redis does not know for an orphan, so a
    stack of other tests sharing it would lose its boxes."""
    data = tmp_path_factory.mktemp("autoscale")
    stack = start_stack(
        data / "stack",
        tiny_model_dir,
        script=SCRIPT,
        workers={"init": 1, "eval": 1},
        sandbox_dir=data / "boxes",
        # A worker started by a launcher (a Slurm job, a local process) is slow to come up and
        # slower under a loaded machine; no test here is about time limits, so a `SLOW` job's
        # RUN gets the room production gives it, not the short limits of other stacks.
        **RELAXED_LIMITS,
    )
    with stack:
        yield stack


@pytest.fixture(scope="package")
def store(runless_stack: Stack) -> Iterator[JobStore]:
    client = redis.Redis.from_url(runless_stack.redis_url)
    yield JobStore(client, runless_stack.settings.key_prefix)
    client.close()


@pytest.fixture
def fast_task() -> dict[str, str]:
    """A math job the development server answers at once."""
    return {"data_source": "math", "problem": "FAST: What is 2+2?", "answer": "4"}


@pytest.fixture
def slow_task() -> dict[str, str]:
    """A math job whose model call takes `SLOW_SECONDS`."""
    return {"data_source": "math", "problem": "SLOW: What is 2+2?", "answer": "4"}
