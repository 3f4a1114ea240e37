"""Fixtures of the broker tests."""

from __future__ import annotations

import pytest
import redis

from broker.jobstore import JobStore


@pytest.fixture
def store(redis_url: str) -> JobStore:
    """A job store (key prefix `t:`) on the test's empty Redis database."""
    return JobStore(redis.Redis.from_url(redis_url), prefix="t:")
