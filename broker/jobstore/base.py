"""What every concern of the job store shares: the Redis connection, key names and scripts."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from broker.resultstore import ResultsStore, results_store
from core.schemas import TERMINAL_STATUSES
from core.settings import get_settings

TERMINAL = ",".join(sorted(s.value for s in TERMINAL_STATUSES))
"""The final statuses as the scripts take them (comma-separated)."""


@cache
def lua(name: str) -> str:
    """The text of the script `lua/{name}.lua`, shipped with the package."""
    return (resources.files("broker.jobstore") / "lua" / f"{name}.lua").read_text()


def text(value: Any) -> str:
    """A Redis reply (bytes, or text from a decoding client) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


class StoreBase:
    """One Redis connection, the keys under `prefix`, the registered Lua scripts and the
    results store that finished trajectories move to (by default the one the settings name).

    `ttl` is how long a job's record lives; once its trajectory was delivered, its stub lives
    `stub_ttl` seconds more (default: `ROLLSERVE_RESULTS_STUB_TTL`)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "rs:",
        ttl: int = 7 * 86400,
        *,
        results: ResultsStore | None = None,
        stub_ttl: int | None = None,
    ) -> None:
        self.r = client
        self.p = prefix
        self.ttl = ttl
        if results is None or stub_ttl is None:
            settings = get_settings()
            results = results if results is not None else results_store(settings)
            stub_ttl = stub_ttl if stub_ttl is not None else settings.results_stub_ttl
        self.results = results
        self.stub_ttl = stub_ttl
        self._transition = self._script("transition")
        self._save_partial = self._script("save_partial", lib=True)
        self._offload = self._script("offload", lib=True)
        self._deliver = self._script("deliver", lib=True)
        self._finish = self._script("finish", lib=True)
        self._draw = self._script("draw", lib=True)
        self._stage_begin = self._script("stage_begin")
        self._stage_end = self._script("stage_end", lib=True)
        self._cancel_begin = self._script("cancel_begin", lib=True)
        self._cancel_end = self._script("cancel_end", lib=True)
        self._claim_unsent = self._script("claim_unsent")
        self._ended = self._script("ended")

    def _script(self, name: str, *, lib: bool = False) -> Script:
        """Register `lua/{name}.lua`; with `lib`, after the shared helpers of `lua/lib.lua`."""
        return self.r.register_script((lua("lib") if lib else "") + lua(name))

    # ------------------------------------------------------------------ keys
    def _job(self, job_id: str) -> str:
        return f"{self.p}job:{job_id}"

    def _traj(self, job_id: str) -> str:
        """The trajectory's head: its fields but the turns and the flattened arrays."""
        return f"{self.p}traj:{job_id}"

    def _turns(self, job_id: str) -> str:
        """The trajectory's turns, one JSON entry each."""
        return f"{self.p}turns:{job_id}"

    def _sums(self, job_id: str) -> str:
        """The digests of the stored turns, 8 bytes each, in order."""
        return f"{self.p}sums:{job_id}"

    def _batch(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}"

    def _batch_stream(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}:done"

    def _batch_jobs(self, batch_id: str) -> str:
        return f"{self.p}batch:{batch_id}:jobs"

    def _wake(self, job_id: str) -> str:
        return f"{self.p}wake:{job_id}"

    def _group(self, group_id: str) -> str:
        return f"{self.p}group:{group_id}"

    def _bkey(self, batch_id: str, part: str) -> str:
        return f"{self.p}batch:{batch_id}:{part}"

    @property
    def _counts(self) -> str:
        return f"{self.p}counts"

    @property
    def _done(self) -> str:
        return f"{self.p}done"

    def _hist(self, stage: str) -> str:
        return f"{self.p}hist:{stage}"

    def _tenant_live(self, tenant: str) -> str:
        return f"{self.p}tenant:{tenant}:live"

    @property
    def transit_key(self) -> str:
        """Sorted set: live jobs that hold no stage and wait for the message of their next
        one (created, or a stage just ended), by the time they began waiting."""
        return f"{self.p}transit"
