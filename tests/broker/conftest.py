"""Fixtures of the broker tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from broker.jobstore import JobStore
from broker.resultstore import DirectoryResults


@pytest.fixture
def results(tmp_path: Path) -> DirectoryResults:
    """A results store in the test's own directory, keeping results a day."""
    return DirectoryResults(tmp_path / "results", keep=86400)


@pytest.fixture
def store(redis_url: str, results: DirectoryResults) -> JobStore:
    """A job store (key prefix `t:`) on the test's empty Redis database, its finished
    trajectories in `results`."""
    return JobStore(redis.Redis.from_url(redis_url), prefix="t:", results=results, stub_ttl=60)
