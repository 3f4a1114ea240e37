"""The one wait-until helper: poll a condition instead of sleeping a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds.

    The timeout only stops a hung test: it is no bound on how fast the condition comes."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> None:
    """`wait_until` for a coroutine: the event loop keeps running while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
