"""A batch of 10,000 jobs lists and filters a page at a time: a page reads only its own jobs."""

from __future__ import annotations

import uuid

import redis
from fastapi.testclient import TestClient

from broker.jobstore import JobStore
from core.schemas import JobStatus
from tests.ui.conftest import specs_of


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0))


def test_a_page_of_a_10000_job_batch_reads_only_that_page(
    app_client: TestClient, store: JobStore, redis_url: str
) -> None:
    batch_id = uuid.uuid4().hex
    specs = specs_of(batch_id, 2500, 4)
    store.create_jobs(specs, batch_id=batch_id, group_size=4)  # one pipelined transaction
    # a few of them failed, near the end of the batch
    pipe = store.r.pipeline(transaction=False)
    for spec in specs[-3:]:
        pipe.hset(store.job_key(spec.job_id), "status", JobStatus.failed.value)
    pipe.execute()
    counter = redis.Redis.from_url(redis_url)
    counter.config_resetstat()
    page = app_client.get(f"/ui/batches/{batch_id}", params={"page": 3})
    assert page.status_code == 200
    assert "10000 jobs" in page.text
    assert specs[100].job_id in page.text and specs[150].job_id not in page.text
    # status and group of the page's 50 jobs, nothing of the other 9,950, no trajectory
    assert calls(counter, "hmget") == 50
    assert calls(counter, "hgetall") <= 2  # the batch's own counters
    assert calls(counter, "lrange") == 1
    filtered = app_client.get(f"/ui/batches/{batch_id}/jobs", params={"status": "failed"})
    assert [s.job_id in filtered.text for s in specs[-3:]] == [True, True, True]
    assert "3 jobs" in filtered.text
    listed = app_client.get("/ui/batches")
    assert batch_id[:12] in listed.text
    counter.close()
