"""Prometheus metrics, read from Redis at scrape time so every gateway replica agrees."""

from __future__ import annotations

import time
from collections.abc import Iterator
from threading import Lock

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry
from pydantic import ValidationError

from api.service import Services
from broker.celery_app import QUEUES
from core.schemas import STAGES, SandboxLimitSupport, Stats
from workers.boxreport import read_reports


def queue_depths(svc: Services) -> dict[str, int]:
    """Messages waiting in each Celery queue (kombu keeps a Redis list per queue)."""
    client = svc.store.r
    return {queue: int(client.llen(queue)) for queue in QUEUES}


class WorkerCensus:
    """Worker processes per queue, from a Celery broadcast, cached for a few seconds."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl = ttl
        self._at = 0.0
        self._value: dict[str, int] = {}
        self._lock = Lock()

    def count(self, svc: Services) -> dict[str, int]:
        with self._lock:
            if time.monotonic() - self._at > self.ttl:
                self._value = self._ask(svc)
                self._at = time.monotonic()
            return dict(self._value)

    @staticmethod
    def _ask(svc: Services) -> dict[str, int]:
        counts = dict.fromkeys(QUEUES, 0)
        inspect = svc.celery.control.inspect(timeout=0.5)
        queues = inspect.active_queues() or {}
        stats = inspect.stats() or {}
        for worker, worker_queues in queues.items():
            processes = len(stats.get(worker, {}).get("pool", {}).get("processes", [])) or 1
            for queue in worker_queues:
                name = queue.get("name")
                if name in counts:
                    counts[name] += processes
        return counts


census = WorkerCensus()


def collect_stats(svc: Services) -> Stats:
    jobs = svc.store.status_counts()
    done = svc.store.finished_since(time.time() - 60)
    return Stats(
        queues=queue_depths(svc),
        jobs=jobs,
        busy={stage: jobs.get(stage, 0) for stage in STAGES},
        workers=census.count(svc),
        backends=svc.pool.in_flight(),
        completed_last_minute=done,
        throughput_per_s=done / 60.0,
        sandbox_limits=sandbox_limits(svc),
    )


def sandbox_limits(svc: Services) -> dict[str, dict[str, SandboxLimitSupport]] | None:
    """Which box-wide limits each worker node's sandboxes get, as the nodes reported it
    (`workers.boxreport`); None when none has."""
    found: dict[str, dict[str, SandboxLimitSupport]] = {}
    for node, report in read_reports(svc.store.r, svc.settings.key_prefix).items():
        try:
            found[node] = {
                limit: SandboxLimitSupport.model_validate(support)
                for limit, support in report.items()
            }
        except (ValidationError, AttributeError):
            continue  # written by a worker of another version
    return found or None


class RolloutCollector(Collector):
    def __init__(self, svc: Services) -> None:
        self.svc = svc

    def collect(
        self,
    ) -> Iterator[GaugeMetricFamily | HistogramMetricFamily | CounterMetricFamily]:
        jobs = GaugeMetricFamily("rollserve_jobs", "Jobs by status", labels=["status"])
        for status, count in self.svc.store.status_counts().items():
            jobs.add_metric([status], count)
        yield jobs
        queues = GaugeMetricFamily(
            "rollserve_queue_depth", "Messages waiting per queue", labels=["queue"]
        )
        for queue, depth in queue_depths(self.svc).items():
            queues.add_metric([queue], depth)
        yield queues
        in_flight = GaugeMetricFamily(
            "rollserve_backend_in_flight", "Jobs holding each backend", labels=["backend"]
        )
        states = GaugeMetricFamily(
            "rollserve_backend_state",
            "1 for each backend's state: healthy, draining or dead",
            labels=["backend", "state"],
        )
        for backend in self.svc.pool.list():
            in_flight.add_metric([backend.id], backend.in_flight)
            for state in ("healthy", "draining", "dead"):
                states.add_metric([backend.id, state], 1.0 if backend.state == state else 0.0)
        yield in_flight
        yield states
        durations = HistogramMetricFamily(
            "rollserve_stage_duration_seconds", "Seconds jobs spent in each stage", labels=["stage"]
        )
        for stage in STAGES:
            buckets, count, total = self.svc.store.stage_histogram(stage)
            points = [(repr(bound), float(n)) for bound, n in buckets] + [("+Inf", float(count))]
            durations.add_metric([stage], points, total)
        yield durations
        ignored = CounterMetricFamily(
            "rollserve_ignored_cancellations",
            "Jobs whose task on a many-jobs RUN worker went on after it was cancelled",
            value=self.svc.store.ignored_cancellations(),
        )
        yield ignored


def registry_for(svc: Services) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RolloutCollector(svc))
    return registry
