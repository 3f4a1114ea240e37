"""DAPO dynamic sampling in the service: a batch's tasks are a pool from which groups are drawn
until `target_groups` informative groups (not every reward equal) are complete.

Nothing polls. The job store's finish script (`broker/jobstore/lua/finish.lua`) sees a
group's last job end, judges the group (accepted, filtered: uniform rewards, failed,
cancelled, surplus: after the target), pushes a set-aside task back into the pool while it
has attempts left, and draws new groups while fewer than `max_inflight_groups` are in flight —
creating their jobs in the same atomic script, so two groups ending at once never overdraw.
The process that recorded the end (the EVAL worker, or whoever cancelled or failed the job)
sends the drawn jobs to Celery (`Dispatcher.finish` → `Dispatcher.follow_up`); the end that
completes the `target_groups`-th accepted group flips the batch to `cancelling` in that same
script, exactly once, and its process cancels every unfinished job of the batch
(`Dispatcher.cancel_batch`). The batch is `done` when every cancelled job is confirmed
stopped: its running stage ended or was killed (the worker's `task_revoked` handler) and its
sandbox released (`workers/lifecycle.py`).

A task's attempt `a` (0-based) samples with seeds `seed + a*group_size + i`, so a redraw is a
fresh group rather than a replay of the set-aside one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from broker.jobstore import DynamicOptions, PoolTask
from workers.dispatch import Dispatcher, DispatchError

log = logging.getLogger(__name__)


def attempt_samplings(
    sampling: dict[str, Any], group_size: int, attempts: int
) -> list[dict[str, Any]]:
    """The sampling of each attempt of a task: the base seed moved on by a group per attempt."""
    seed = sampling.get("seed")
    return [
        {**sampling, "seed": None if seed is None else int(seed) + a * group_size}
        for a in range(attempts)
    ]


def submit_dynamic(
    dispatcher: Dispatcher,
    batch_id: str,
    pool: Sequence[PoolTask],
    options: DynamicOptions,
    sampling: dict[str, Any],
    agent: dict[str, Any],
    tenant: str = "",
) -> list[str]:
    """Write the batch, draw its first `max_inflight_groups` groups and send them; returns
    their job ids. On a broker error nothing of the batch is left. Every job the batch ever
    draws counts against `tenant`'s unfinished jobs until it ends."""
    store = dispatcher.store
    samplings = attempt_samplings(sampling, options.group_size, options.max_attempts_per_task)
    job_ids = store.create_dynamic_batch(batch_id, pool, options, samplings, agent, tenant)
    try:
        dispatcher.send_drawn(batch_id, job_ids)
    except Exception as exc:
        log.exception("sending the first groups of batch %s failed", batch_id)
        store.delete_batch(batch_id)
        raise DispatchError(f"the broker did not take the jobs: {exc}") from exc
    return job_ids
