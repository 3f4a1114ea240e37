"""What the console's pages show, as plain functions over the gateway's services."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from api import owners
from api.metrics import collect_stats
from api.service import Services
from broker.jobstore.listing import JobRow
from core.schemas import STAGES, Stats

HISTOGRAM_JOBS = 2000
"""The batch's reward histogram and group verdicts cover its most recently finished jobs,
at most this many (a bounded read, whatever the batch's size)."""


@dataclass
class BatchRow:
    batch_id: str
    created_at: float
    total: int
    finished: int
    counts: dict[str, int]
    mean_reward: float | None
    dynamic: bool
    state: str


def batch_rows(
    svc: Services, offset: int, limit: int, tenant: str | None = None
) -> tuple[list[BatchRow], int]:
    """A page of batches, newest first, from their counters alone, and how many there are:
    every batch (`tenant` None: the admin), or only those `tenant` submitted."""
    if tenant is None:
        hashes, total = svc.store.list_batches(offset, limit), svc.store.batch_count()
    else:
        ttl = svc.settings.job_ttl
        hashes, total = owners.tenant_batches(svc.store, tenant, ttl, offset, limit)
    rows = []
    for h in hashes:
        total = int(h.get("total", 0))
        finished = int(h.get("finished", 0))
        reward_n = int(h.get("reward_n", 0))
        counts = {k[2:]: int(v) for k, v in h.items() if k.startswith("n_") and int(v)}
        dynamic = h.get("dynamic") == "1"
        state = h.get("state", "") if dynamic else ("done" if finished >= total else "running")
        rows.append(
            BatchRow(
                batch_id=h["batch_id"],
                created_at=float(h.get("created_at", 0.0)),
                total=total,
                finished=finished,
                counts=counts,
                mean_reward=float(h["reward_sum"]) / reward_n if reward_n else None,
                dynamic=dynamic,
                state=state,
            )
        )
    return rows, total


@dataclass
class Bin:
    low: float
    high: float
    count: int


def histogram(rewards: list[float], bins: int = 10) -> list[Bin]:
    """Rewards counted in `bins` equal bins between their least and greatest value (one bin
    when they are all equal)."""
    if not rewards:
        return []
    low, high = min(rewards), max(rewards)
    if math.isclose(low, high):
        return [Bin(low, high, len(rewards))]
    width = (high - low) / bins
    counts = [0] * bins
    for reward in rewards:
        counts[min(bins - 1, int((reward - low) / width))] += 1
    return [Bin(low + i * width, low + (i + 1) * width, n) for i, n in enumerate(counts)]


@dataclass
class GroupSummary:
    """Verdicts of the groups whose jobs are all among the jobs read."""

    informative: int = 0
    uniform: int = 0
    incomplete: int = 0
    groups: list[tuple[str, list[float | None], str]] = field(default_factory=list)


def group_summary(rows: list[tuple[str, str, float | None]], group_size: int) -> GroupSummary:
    """Group the jobs' rewards: a group with all `group_size` rewards is informative when they
    are not all equal, uniform when they are; any other group is incomplete."""
    by_group: dict[str, list[float | None]] = {}
    for _, group_id, reward in rows:
        by_group.setdefault(group_id, []).append(reward)
    summary = GroupSummary()
    for group_id, rewards in by_group.items():
        known = [r for r in rewards if r is not None]
        if len(known) < group_size:
            verdict = "incomplete"
            summary.incomplete += 1
        elif len(set(known)) > 1:
            verdict = "informative"
            summary.informative += 1
        else:
            verdict = "uniform"
            summary.uniform += 1
        summary.groups.append((group_id, rewards, verdict))
    return summary


def batch_rewards(svc: Services, batch_id: str) -> list[tuple[str, str, float | None]]:
    return svc.store.batch_rewards(batch_id, HISTOGRAM_JOBS)


def reward_values(rows: list[tuple[str, str, float | None]] | list[JobRow]) -> list[float]:
    values: list[float] = []
    for row in rows:
        reward = row.reward if isinstance(row, JobRow) else row[2]
        if reward is not None:
            values.append(reward)
    return values


@dataclass
class QueueLine:
    queue: str
    waiting: int
    busy: int
    workers: int

    @property
    def busy_share(self) -> float | None:
        return self.busy / self.workers if self.workers else None


@dataclass
class Fleet:
    stats: Stats
    queues: list[QueueLine]
    per_minute: list[tuple[int, float]]
    """(minutes ago, jobs per second finished in that minute), the latest minute first."""


FLEET_MINUTES = 10


def fleet(svc: Services) -> Fleet:
    """Queues, workers, busy share and throughput: `GET /v1/stats` per queue, and the jobs
    finished in each of the last minutes (the completions kept for an hour)."""
    stats = collect_stats(svc)
    names = [s for s in STAGES if s in {*stats.queues, *stats.busy, *stats.workers}]
    names += sorted({*stats.queues, *stats.workers} - set(names))
    queues = [
        QueueLine(q, stats.queues.get(q, 0), stats.busy.get(q, 0), stats.workers.get(q, 0))
        for q in names
    ]
    now = time.time()
    since = [svc.store.finished_since(now - 60 * m) for m in range(1, FLEET_MINUTES + 1)]
    per_minute = []
    previous = 0
    for minutes, count in enumerate(since):
        per_minute.append((minutes, (count - previous) / 60.0))
        previous = count
    return Fleet(stats, queues, per_minute)


def json_blocks(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """A report's fields in a stable order, the long texts (patches, logs) last."""

    def long(value: Any) -> bool:
        return isinstance(value, str) and (len(value) > 200 or "\n" in value)

    return sorted(data.items(), key=lambda kv: (long(kv[1]), kv[0]))
