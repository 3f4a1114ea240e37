"""The pipeline's end-to-end behaviour with a many-jobs RUN worker (`--jobs N`): every test of
`test_pipeline` runs again against a stack whose RUN worker holds its jobs on one event loop
(Celery's threads pool), where cancellation and time limits cancel a job's task instead of
killing a process. Only the test that kills a prefork pool child has no counterpart here."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import RolloutClient
from core.schemas import JobStatus
from deploy.stack import Stack
from tests.e2e.test_pipeline import (
    PATIENT,
    SCRIPT,
    test_a_failing_job_does_not_fail_its_batch,
    test_a_job_past_its_run_time_limit_is_timed_out_with_its_backend_freed,
    test_a_transient_backend_error_is_retried,
    test_cancelled_job_is_cancelled_and_no_later_stage_runs,
    test_group_samples_get_their_own_seeds_and_rewards,
    test_multi_turn_appends_observations_masked_out,
    test_results_stream_before_the_batch_ends,
    test_rollout_with_wait_returns_the_graded_trajectory,
    test_run_worker_killed_mid_job_still_completes_once,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

__all__ = [
    "test_a_failing_job_does_not_fail_its_batch",
    "test_a_job_past_its_run_time_limit_is_timed_out_with_its_backend_freed",
    "test_a_transient_backend_error_is_retried",
    "test_cancelled_job_is_cancelled_and_no_later_stage_runs",
    "test_group_samples_get_their_own_seeds_and_rewards",
    "test_multi_turn_appends_observations_masked_out",
    "test_results_stream_before_the_batch_ends",
    "test_rollout_with_wait_returns_the_graded_trajectory",
    "test_run_worker_killed_mid_job_still_completes_once",
]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"script": SCRIPT, "workers": {"init": 1, "run": 1, "eval": 1}, "run_jobs": 16}


def backend_queue(url: str, api_key: str) -> float:
    """Requests the development server holds now (waiting on their delay, or running)."""
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    text = answer.text
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_one_process_holds_many_jobs_at_once(client: RolloutClient, stack: Stack) -> None:
    # A fresh many-jobs RUN worker alone on the queue (an earlier test replaced the first).
    for name in [n for n in stack.worker_names if n.startswith("worker-run")]:
        stack.kill_worker(name, signal.SIGTERM)
    run_worker = stack.start_worker("run", 1, jobs=16)
    stack.wait_worker(run_worker)
    worker = stack.children[run_worker].pid
    tasks = [{**PATIENT, "instance_id": f"patient-{i}"} for i in range(12)]
    accepted = client.submit_batch(tasks, group_size=1, sampling={"seed": 0})
    # PATIENT answers after 3 s: all twelve wait on the backend at once, from one process.
    wait_until(
        lambda: backend_queue(stack.dev_backend_url, stack.backend_api_key) >= 12,
        30,
        "12 requests in flight",
    )
    children = Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
    assert children == []  # no pool processes: the jobs are coroutines of the worker itself
    results = list(client.iter_batch_results(accepted.batch_id))
    assert sorted(t.instance_id for t in results) == sorted(t["instance_id"] for t in tasks)
    assert all(t.status is JobStatus.completed and t.reward == 1.0 for t in results)
    assert all(b.in_flight == 0 for b in client.list_backends())
