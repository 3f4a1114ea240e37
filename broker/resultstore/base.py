"""The interface of a results store and what its kinds share."""

from __future__ import annotations

import calendar
import hashlib
import re
import time
from abc import ABC, abstractmethod

_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,120}")

HOUR_FORMAT = "%Y%m%d%H"
"""How an hour of finishing names its partition (UTC)."""


def hour_of(when: float) -> str:
    """The partition (`YYYYmmddHH`, UTC) of a result finished at Unix time `when`."""
    return time.strftime(HOUR_FORMAT, time.gmtime(when))


def hour_start(hour: str) -> float | None:
    """The Unix time an hour partition begins, or None for a name that is not one."""
    if not re.fullmatch(r"[0-9]{10}", hour):
        return None
    try:
        return float(calendar.timegm(time.strptime(hour, HOUR_FORMAT)))
    except ValueError:
        return None


def safe_name(name: str) -> str:
    """`name` as a file or object name: itself when plain, else a digest of it."""
    if _SAFE.fullmatch(name) and not name.startswith("."):
        return name
    return "h" + hashlib.blake2b(name.encode(), digest_size=16).hexdigest()


class ResultsStore(ABC):
    """Finished trajectories as JSON lines, by job, kept `keep` seconds."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self._pruned_hour = ""

    @abstractmethod
    def put(self, job_id: str, batch_id: str | None, line: bytes, now: float) -> str:
        """Store one finished trajectory (`line`: its JSON, no newline) durably; returns its
        location, which `read` takes."""

    @abstractmethod
    def read(self, location: str) -> bytes | None:
        """The JSON stored at `location`, or None when it is gone, pruned or incomplete."""

    @abstractmethod
    def find(self, job_id: str) -> bytes | None:
        """The latest JSON stored for `job_id` within the retention window, or None; slower
        than `read` (it searches the hours, newest first)."""

    @abstractmethod
    def hours(self) -> list[str]:
        """The hour partitions present, oldest first."""

    @abstractmethod
    def drop_hour(self, hour: str) -> None:
        """Delete an hour partition and everything in it."""

    def prune(self, now: float | None = None) -> list[str]:
        """Delete the hours that ended more than `keep` seconds before `now`; returns them."""
        cutoff = (time.time() if now is None else now) - self.keep
        dropped = []
        for hour in self.hours():
            start = hour_start(hour)
            if start is not None and start + 3600 <= cutoff:
                self.drop_hour(hour)
                dropped.append(hour)
        return dropped

    def prune_hourly(self, now: float) -> None:
        """`prune`, at most once per hour of `now` for this store object (cheap to call at
        every write)."""
        hour = hour_of(now)
        if hour != self._pruned_hour:
            self._pruned_hour = hour
            self.prune(now)
