"""`workers.aio.settle`: ignores how the awaited work ends, never the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from workers.aio import settle


async def failing() -> None:
    raise RuntimeError("the engine said no")


def test_the_works_error_and_timeout_are_ignored() -> None:
    async def main() -> None:
        await settle(failing())
        await settle(asyncio.sleep(10), timeout=0.01)

    asyncio.run(main())


def test_the_works_own_cancellation_is_ignored() -> None:
    async def main() -> bool:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        inner.cancel()
        await settle(inner)
        return inner.cancelled()

    assert asyncio.run(main())


def test_the_callers_cancellation_propagates() -> None:
    """The task waiting in `settle` is cancelled: it ends cancelled, it does not go on."""
    went_on: list[bool] = []

    async def waiter() -> None:
        await settle(asyncio.sleep(10))
        went_on.append(True)

    async def main() -> None:
        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert went_on == []


def test_a_caller_cancelled_while_handling_its_own_cancel_still_ends_cancelled() -> None:
    """The pattern of a cleanup in `except CancelledError`: a second cancel during the
    cleanup's wait is not lost."""
    cleaned: list[bool] = []

    async def worker() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await settle(asyncio.sleep(10), timeout=5)
            cleaned.append(True)
            raise

    async def main() -> None:
        task = asyncio.ensure_future(worker())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cleaned == []  # the second cancel cut the cleanup short instead of waiting 5 s
