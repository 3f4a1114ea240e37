"""Baseline for bench/pipeline.py: a bare Celery chain of three no-op tasks on three queues,
with rollserve's own Celery settings (prefork, late acks, prefetch one, task events)."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, chain

from broker.celery_app import create_celery
from core.settings import Settings

app: Celery = create_celery(
    Settings(), os.environ.get("FLOOR_REDIS_URL", "redis://127.0.0.1:6379/0")
)
app.conf.task_routes = {f"floor.{q}": {"queue": q} for q in ("init", "run", "eval")}
app.conf.include = []


@app.task(name="floor.init")
def floor_init(key: str) -> None:
    return None


@app.task(name="floor.run")
def floor_run(key: str) -> None:
    return None


@app.task(name="floor.eval")
def floor_eval(key: str) -> None:
    redis.Redis.from_url(app.conf.broker_url).rpush(key, time.time())


def chain_latency(client: redis.Redis, runs: int) -> list[float]:
    """Seconds from sending the 3-task chain to its last task finishing, per run."""
    latencies = []
    for i in range(runs):
        key = f"floor:{i}"
        started = time.time()
        chain(floor_init.si(key), floor_run.si(key), floor_eval.si(key)).apply_async()
        answer = client.blpop([key], timeout=30)
        assert answer is not None, "the floor chain did not finish"
        latencies.append(float(answer[1]) - started)
    return latencies
