"""The job store: its concerns composed over one Redis connection."""

from __future__ import annotations

from broker.jobstore.batches import Batches
from broker.jobstore.liveness import Liveness
from broker.jobstore.marks import Marks
from broker.jobstore.metrics import Metrics
from broker.jobstore.records import Records


class JobStore(Records, Batches, Marks, Metrics, Liveness):
    """Job records in Redis under `prefix`; all methods are synchronous and safe to call twice."""
