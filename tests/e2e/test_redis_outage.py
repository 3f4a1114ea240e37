"""Redis killed outright mid-batch: the supervisor restarts it from its append-only file, the
gateway and workers reconnect by themselves, and every job reaches the client exactly once."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from api.client import RolloutClient, RolloutServiceError
from core.schemas import BatchProgress, JobStatus
from deploy.stack import Stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

SCRIPT = [{"match": "SLOW-ADD", "samples": [["So it is \\boxed{4}."]], "delay": 1.0}]
TASKS = [
    {"data_source": "math", "instance_id": f"add-{i}", "problem": "SLOW-ADD: 2+2?", "answer": "4"}
    for i in range(8)
]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"script": SCRIPT, "workers": {"init": 1, "run": 2, "eval": 1}}


def progress_or_none(client: RolloutClient, batch_id: str) -> BatchProgress | None:
    """The batch's progress, or None while the gateway answers 503 (Redis down)."""
    try:
        return client.batch_progress(batch_id)
    except RolloutServiceError as exc:
        assert exc.status_code in (503, None), exc
        return None


def test_a_batch_survives_redis_killed_mid_way(stack: Stack, client: RolloutClient) -> None:
    accepted = client.submit_batch(TASKS, group_size=3, sampling={"seed": 0})
    total = len(accepted.jobs)
    wait_until(
        lambda: client.batch_progress(accepted.batch_id).finished >= 4, 120, "four finished jobs"
    )
    assert stack.redis is not None and stack.redis.pid is not None
    old_pid = stack.redis.pid
    killed = time.monotonic()
    os.killpg(old_pid, signal.SIGKILL)

    wait_until(lambda: stack.redis is not None and stack.redis.pid not in (None, old_pid), 60,
               "a restarted Redis")  # fmt: skip
    wait_until(
        lambda: httpx.get(f"{stack.gateway_url}/healthz", timeout=10).json()["redis"],
        60,
        "the gateway to reach Redis again",
    )
    back = time.monotonic() - killed
    progress = progress_or_none(client, accepted.batch_id)
    assert progress is not None and progress.total == total  # the batch outlived Redis

    wait_until(
        lambda: (p := progress_or_none(client, accepted.batch_id)) is not None and p.done,
        240, "the batch to finish after the restart",
    )  # fmt: skip
    done = time.monotonic() - killed
    results = list(client.iter_batch_results(accepted.batch_id))
    ids = [t.job_id for t in results]
    assert sorted(ids) == sorted(accepted.jobs)  # every job, none twice
    assert {t.status for t in results} == {JobStatus.completed}
    assert {t.reward for t in results} == {1.0}
    store = redis.Redis.from_url(stack.redis_url)
    assert store.xlen(f"rs:batch:{accepted.batch_id}:done") == total  # recorded once each

    # A stage whose acknowledgement was lost with the connection is delivered again once its
    # visibility timeout passes; that delivery finds the stage done and changes nothing.
    wait_until(lambda: store.hlen("unacked") == 0, 120, "no unacknowledged stage left")
    again = redelivered(stack, accepted.jobs)
    assert store.xlen(f"rs:batch:{accepted.batch_id}:done") == total
    assert sorted(t.job_id for t in client.iter_batch_results(accepted.batch_id)) == sorted(
        accepted.jobs
    )
    print(
        f"\nRedis SIGKILL: store back in {back:.1f}s, batch finished {done:.1f}s after it; "
        f"{len(again)} stage message(s) delivered twice: {again}"
    )


def redelivered(stack: Stack, job_ids: list[str]) -> dict[str, int]:
    """Stage task ids of these jobs that a worker received more than once (from its log)."""
    counts: Counter[str] = Counter()
    for log_file in (stack.data_dir / "logs").glob("worker-*.log"):
        counts.update(
            re.findall(r"Task rollserve\.\w+\[(\w+-\w+)\] received", log_file.read_text())
        )
    jobs = set(job_ids)
    return {t: n for t, n in counts.items() if n > 1 and t.split("-")[0] in jobs}
