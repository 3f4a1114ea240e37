"""What a job costs Redis, for benchmarks: bytes written per token while it runs, and memory
once its trajectory was delivered."""

from __future__ import annotations

from broker.jobstore.store import JobStore


def bytes_written_per_token(store: JobStore, job_id: str) -> float:
    """Bytes of trajectory the job wrote to Redis (turn entries, digests, heads: see
    `JobStore.written_bytes`) per token of its sequence (first prompt and everything after)."""
    trajectory = store.trajectory(job_id)
    tokens = len(trajectory.prompt_ids) + len(trajectory.response_ids)
    return store.written_bytes(job_id) / max(1, tokens)


def memory_after_delivery(store: JobStore, job_id: str) -> int:
    """Deliver the finished job (as `GET /v1/rollouts/{id}` does) and return the bytes of
    Redis memory it still takes: its record, pointing to the results store, until that
    expires `stub_ttl` seconds later (then nothing)."""
    store.delivered(job_id)
    return store.stored_bytes(job_id)
