"""Waiting on work whose end does not matter, without swallowing the caller's cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def settle(work: Awaitable[Any], timeout: float | None = None) -> None:
    """Await `work` for its side effects and ignore how it ends: its error, its own
    cancellation, the `timeout`. The caller's own cancellation is never ignored: when the
    task awaiting this is being cancelled, `CancelledError` propagates (a bare
    `suppress(BaseException)` would swallow it, and `KeyboardInterrupt` and `SystemExit` too).
    """
    try:
        await asyncio.wait_for(work, timeout)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        return
