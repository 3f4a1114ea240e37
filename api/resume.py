"""Resuming a results stream: each line's cursor, and when and how soon to reopen the stream.

The gateway gives every line of `GET /v1/batches/{id}/results` a `cursor`; `?after=` with it
reopens the stream right after that line, on any gateway. `Resume` is the bookkeeping the
clients of `api.client` keep for one stream: the last cursor, whether the stream has opened,
and the outage in progress, if any.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import httpx

from core.schemas import Trajectory

RESUME_SECONDS = 120.0
"""How long a broken results stream is retried, per outage, before the client gives up."""

FIRST_PAUSE = 0.1
"""Seconds before the second attempt to reopen a stream; each later pause doubles it."""

LONGEST_PAUSE = 5.0
"""The longest pause between two attempts to reopen a stream."""


class ResultLine(NamedTuple):
    """One line of a results stream: the trajectory and its `cursor` (None from a gateway
    that sends none), which `after=` resumes right after."""

    cursor: str | None
    trajectory: Trajectory


class Resume:
    """The reconnection bookkeeping of one results stream.

    Once the stream has opened, a broken connection (no status) or a 5xx answer is retried
    with `after=` the last cursor received: at once, then after pauses doubling from
    `FIRST_PAUSE` up to `LONGEST_PAUSE`, until `resume_for` seconds have passed since the
    outage began. Any line received, keep-alives too, ends an outage. A failure before the
    stream first opened, a 4xx, or a break after a line without a cursor is final."""

    def __init__(self, batch_id: str, after: str | None, resume_for: float) -> None:
        self.batch_id = batch_id
        self.cursor = after
        """The cursor of the last line received (`after` until one is)."""
        self.resume_for = resume_for
        self.opened = False
        """Whether the gateway has answered 200 to this stream once."""
        self.resumable = True
        """False once a line came without a cursor: the place in the stream is lost."""
        self.gave_up = False
        """True once an outage outlasted `resume_for`."""
        self._since: float | None = None
        self._pause = 0.0

    def params(self) -> dict[str, str]:
        """The query of the next request for the stream."""
        return {} if self.cursor is None else {"after": self.cursor}

    def timeout(self, base: float) -> httpx.Timeout:
        """No read deadline (a batch may run for hours; keep-alives arrive each second); while
        reconnecting, no connect attempt outlasts what is left of `resume_for`."""
        if self._since is None:
            return httpx.Timeout(base, read=None)
        left = self.resume_for - (time.monotonic() - self._since)
        return httpx.Timeout(min(base, max(left, 0.1)), read=None)

    def alive(self) -> None:
        """A line arrived: the stream works, any outage is over."""
        self._since = None
        self._pause = 0.0

    def take(self, line: ResultLine) -> None:
        """A result line arrived: the stream resumes after it."""
        if line.cursor is None:
            self.resumable = False
        else:
            self.cursor = line.cursor

    def retry_after(self, status_code: int | None) -> float | None:
        """Seconds to wait before reopening the stream after a failure with `status_code`
        (None when no answer came), or None when the failure is final (`gave_up` says whether
        because the time to resume ran out)."""
        retryable = status_code is None or status_code >= 500
        if not (self.opened and self.resumable and retryable and self.resume_for > 0):
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        left = self.resume_for - (now - self._since)
        if left <= 0:
            self.gave_up = True
            return None
        pause = min(self._pause, left)
        self._pause = min(max(self._pause * 2, FIRST_PAUSE), LONGEST_PAUSE)
        return pause
