"""The job store: its concerns composed over one Redis connection."""

from __future__ import annotations

import redis

from broker.jobstore.batches import Batches
from broker.jobstore.listing import Listing
from broker.jobstore.liveness import Liveness
from broker.jobstore.marks import Marks
from broker.jobstore.metrics import Metrics
from broker.jobstore.records import Records
from broker.resultstore import results_store
from core.settings import Settings


class JobStore(Records, Batches, Marks, Metrics, Liveness, Listing):
    """Job records in Redis under `prefix`; all methods are synchronous and safe to call twice."""

    @classmethod
    def for_settings(cls, client: redis.Redis, settings: Settings) -> JobStore:
        """The store as `settings` configure it: prefix, record expiry and results store."""
        return cls(
            client,
            settings.key_prefix,
            settings.job_ttl,
            results=results_store(settings),
            stub_ttl=settings.results_stub_ttl,
        )
