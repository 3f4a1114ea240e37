"""Redis clients that ride out a Redis restart.

A client retries a command that failed on a connection error or timeout, reconnecting with
exponential backoff, for about `patience` seconds before the error reaches the caller. A
restarted Redis (same address and password, its data reloaded from the append-only file) is
thus invisible to a caller beyond the wait. A command whose connection broke after it was
sent may run twice: the job store's writes are guarded by the job's state (a second `finish`
or transition is refused), so a repeat changes nothing but, at worst, a metrics counter.
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

BACKOFF_BASE = 0.05
"""Seconds before the first retry; each next wait doubles, up to `BACKOFF_CAP`."""
BACKOFF_CAP = 1.0


def retries_for(patience: float, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP) -> int:
    """How many retries of a doubling backoff (from `base`, capped at `cap`) add up to at
    least `patience` seconds of waiting (at least one)."""
    waited, retries = 0.0, 0
    while waited < patience or retries == 0:
        retries += 1
        waited += min(cap, base * 2**retries)
    return retries


def redis_client(url: str, patience: float) -> redis.Redis:
    """A client of `url` that retries connection errors for about `patience` seconds."""
    retry = Retry(
        ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE),
        retries_for(patience),
        supported_errors=(RedisConnectionError, RedisTimeoutError, ConnectionResetError),
    )
    return redis.Redis.from_url(url, retry=retry)
