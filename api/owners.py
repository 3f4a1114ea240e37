"""Which tenant owns each batch and rollout, recorded at submission.

A tenant sees, streams and cancels only what it submitted: every read of a batch or a job by
id first asks `owns_batch` / `owns_job`, and one owned by another tenant answers exactly as an
unknown id does (`JobNotFound`, a 404), so ids of other tenants cannot be probed. The admin
(the operator's token, or anyone when no token is configured) sees everything.

The records outlive the job store's (they last as long as the results store keeps results):
`{p}owner:batch:{id}` and `{p}owner:job:{id}` (for rollouts and sessions, not in a batch)
hold the tenant's name, and `{p}owner:tenant:{name}:batches` indexes a tenant's batches by
creation time for the console's list. A job of a batch (a dynamic batch draws jobs long after
the submission) is owned by its batch's owner.
"""

from __future__ import annotations

import time
from typing import Any

from broker.jobstore import JobNotFound, JobStore
from broker.jobstore.base import text


def _batch_key(store: JobStore, batch_id: str) -> str:
    return f"{store.p}owner:batch:{batch_id}"


def _job_key(store: JobStore, job_id: str) -> str:
    return f"{store.p}owner:job:{job_id}"


def _index_key(store: JobStore, tenant: str) -> str:
    return f"{store.p}owner:tenant:{tenant}:batches"


def claim(
    store: JobStore,
    tenant: str,
    ttl: int,
    *,
    batch_id: str | None = None,
    job_id: str | None = None,
) -> None:
    """Record `tenant` as the owner of a batch (indexed for its list) or a lone job, for
    `ttl` seconds; written before the jobs are, so they never exist without an owner."""
    now = time.time()
    pipe = store.r.pipeline(transaction=True)
    if batch_id is not None:
        pipe.set(_batch_key(store, batch_id), tenant, ex=ttl)
        index = _index_key(store, tenant)
        pipe.zadd(index, {batch_id: now})
        pipe.zremrangebyscore(index, "-inf", now - ttl)
        pipe.expire(index, ttl)
    if job_id is not None:
        pipe.set(_job_key(store, job_id), tenant, ex=ttl)
    pipe.execute()


def release(
    store: JobStore, tenant: str, *, batch_id: str | None = None, job_id: str | None = None
) -> None:
    """Undo `claim` when the submission failed and nothing of it was kept."""
    pipe = store.r.pipeline(transaction=True)
    if batch_id is not None:
        pipe.delete(_batch_key(store, batch_id))
        pipe.zrem(_index_key(store, tenant), batch_id)
    if job_id is not None:
        pipe.delete(_job_key(store, job_id))
    pipe.execute()


def batch_owner(store: JobStore, batch_id: str) -> str | None:
    raw = store.r.get(_batch_key(store, batch_id))
    return None if raw is None else text(raw)


def job_owner(store: JobStore, job_id: str) -> str | None:
    """The tenant that owns the job: its own record of ownership, else its batch's (from the
    job's record, or from its trajectory once the record has left Redis), else the tenant
    its record names."""
    pipe = store.r.pipeline(transaction=False)
    pipe.get(_job_key(store, job_id))
    pipe.hmget(store.job_key(job_id), ["batch_id", "tenant"])
    owner, (batch_id, tenant) = pipe.execute()
    if owner is not None:
        return text(owner)
    if batch_id:
        return batch_owner(store, text(batch_id))
    if tenant is not None:
        return text(tenant)
    try:
        trajectory = store.trajectory(job_id)
    except JobNotFound:
        return None
    return batch_owner(store, trajectory.batch_id) if trajectory.batch_id else None


def check_batch(store: JobStore, tenant: str, admin: bool, batch_id: str) -> None:
    """JobNotFound (a 404, as for an unknown id) unless the caller may see the batch."""
    if not admin and batch_owner(store, batch_id) != tenant:
        raise JobNotFound(batch_id)


def check_job(store: JobStore, tenant: str, admin: bool, job_id: str) -> None:
    """JobNotFound (a 404, as for an unknown id) unless the caller may see the job."""
    if not admin and job_owner(store, job_id) != tenant:
        raise JobNotFound(job_id)


def tenant_batches(
    store: JobStore, tenant: str, ttl: int, offset: int, limit: int
) -> tuple[list[dict[str, str]], int]:
    """The hashes of up to `limit` of the tenant's batches from `offset`, newest first, and
    how many it has (batches whose record has expired are dropped from its index)."""
    index = _index_key(store, tenant)
    store.r.zremrangebyscore(index, "-inf", time.time() - ttl)
    ids = [text(x) for x in store.r.zrevrange(index, offset, offset + limit - 1)]
    found: list[dict[str, str]] = []
    gone: list[str] = []
    for batch_id in ids:
        state: dict[str, Any] = store.batch_state(batch_id)
        if not state:
            gone.append(batch_id)
            continue
        state.setdefault("batch_id", batch_id)
        found.append(state)
    if gone:
        store.r.zrem(index, *gone)
    return found, int(store.r.zcard(index))
