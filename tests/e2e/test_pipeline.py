"""End to end on a real stack: REST → Redis → init/run/eval workers → dev backend.

The development server plays scripted completions (scored by the tiny model, so logprobs are
real); every test talks to the gateway over HTTP with the Python client. Each test runs
against both kinds of RUN worker (`RUN_POOLS`): prefork, and one process holding its jobs on
one event loop (`--jobs N`, Celery's threads pool), where cancellation and time limits cancel
a job's task instead of killing a process.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from api.client import RolloutClient
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

SCRIPT = [
    {"match": "FAST-ADD", "samples": [["So 2+2 = \\boxed{4}."], ["I think it is \\boxed{5}."]]},
    {"match": "TWO-TURNS", "samples": [["Let me think about 3 times 4 first.", "\\boxed{12}"]]},
    {"match": "SLOW-SEVEN", "samples": [["Slowly: \\boxed{7}"]], "delay": 3.0},
    {"match": "GLACIAL", "samples": [["\\boxed{1}"]], "delay": 30.0},
    {"match": "REFUSED", "samples": [["\\boxed{2}"]], "errors": [400] * 100},
    {"match": "FLAKY", "samples": [["\\boxed{9}"]], "errors": [503]},
    {"match": "PATIENT", "samples": [["\\boxed{8}"]], "delay": 3.0},
]


def math_task(marker: str, question: str, answer: str) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": marker.lower(),
        "problem": f"{marker}: {question}",
        "answer": answer,
    }


FAST = math_task("FAST-ADD", "What is 2+2?", "4")
TWO_TURNS = math_task("TWO-TURNS", "What is 3 times 4?", "12")
SLOW = math_task("SLOW-SEVEN", "What is 3+4?", "7")
GLACIAL = math_task("GLACIAL", "What is 0+1?", "1")
REFUSED = math_task("REFUSED", "What is 1+1?", "2")
FLAKY = math_task("FLAKY", "What is 4+5?", "9")
PATIENT = math_task("PATIENT", "What is 4+4?", "8")


RUN_POOLS = {"prefork": 0, "jobs": 16}


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"script": SCRIPT}


def assert_aligned(traj: Trajectory) -> None:
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs) > 0
    for mask, logprob in zip(traj.loss_mask, traj.logprobs, strict=True):
        assert (logprob is not None) == (mask == 1)


def test_rollout_with_wait_returns_the_graded_trajectory(client: RolloutClient) -> None:
    traj = client.submit_rollout(FAST, sampling={"seed": 0}, wait=True, timeout=60)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed
    assert traj.reward == 1.0
    assert traj.stop_reason == "answer"
    assert traj.backend_id == "dev"
    assert "\\boxed{4}" in traj.turns[0].text
    assert_aligned(traj)
    assert (
        traj.timing.init is not None
        and traj.timing.run is not None
        and traj.timing.eval is not None
    )


def test_group_samples_get_their_own_seeds_and_rewards(client: RolloutClient) -> None:
    accepted = client.submit_batch([FAST], group_size=2, sampling={"seed": 0})
    results = {t.sample_index: t for t in client.iter_batch_results(accepted.batch_id)}
    assert {i: t.reward for i, t in results.items()} == {0: 1.0, 1: 0.0}
    assert len({t.group_id for t in results.values()}) == 1


def test_multi_turn_appends_observations_masked_out(client: RolloutClient) -> None:
    traj = client.submit_rollout(TWO_TURNS, sampling={"seed": 0}, wait=True, timeout=60)
    assert isinstance(traj, Trajectory)
    assert traj.reward == 1.0
    kinds = [t.type for t in traj.turns]
    assert kinds == ["model", "env", "model"]
    first, env, second = traj.turns
    assert second.prompt_ids == env.observation_ids  # type: ignore[union-attr]
    assert traj.prompt_ids == first.prompt_ids  # type: ignore[union-attr]
    expected = first.output_ids + env.observation_ids + second.output_ids  # type: ignore[union-attr]
    assert traj.response_ids == expected
    n1, n_obs = len(first.output_ids), len(env.observation_ids)  # type: ignore[union-attr]
    assert traj.loss_mask == [1] * n1 + [0] * n_obs + [1] * len(second.output_ids)  # type: ignore[union-attr]
    assert_aligned(traj)


def test_results_stream_before_the_batch_ends(client: RolloutClient) -> None:
    accepted = client.submit_batch([SLOW, FAST], group_size=1, sampling={"seed": 0})
    stream = client.iter_batch_results(accepted.batch_id)
    first = next(stream)
    assert first.instance_id == "fast-add"
    assert not client.batch_progress(accepted.batch_id).done
    rest = list(stream)
    assert [t.instance_id for t in rest] == ["slow-seven"]
    assert client.batch_progress(accepted.batch_id).done


def test_cancelled_job_is_cancelled_and_no_later_stage_runs(
    client: RolloutClient, stack: Stack
) -> None:
    job_id = client.submit_rollout(GLACIAL)
    assert isinstance(job_id, str)
    wait_until(lambda: client.get_rollout(job_id).status is JobStatus.run, 30, "the job to run")
    cancelled = client.cancel_rollout(job_id)
    assert cancelled.status is JobStatus.cancelled
    assert cancelled.error is not None and cancelled.error.stage == "run"
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    # A later job through the same queues: any stray chain link of the cancelled one would
    # have been delivered before it finishes.
    follow_up = client.submit_rollout(FAST, sampling={"seed": 0}, wait=True, timeout=60)
    assert isinstance(follow_up, Trajectory) and follow_up.status is JobStatus.completed
    record = r.hgetall(f"rs:job:{job_id}")
    assert record["status"] == "cancelled"
    assert "t_eval" not in record and "dur_eval" not in record
    assert client.get_rollout(job_id).reward is None
    assert all(b.in_flight == 0 for b in client.list_backends())


def test_run_worker_killed_mid_job_still_completes_once(
    client: RolloutClient, stack: Stack
) -> None:
    accepted = client.submit_batch([SLOW], group_size=1, sampling={"seed": 0})
    [job_id] = accepted.jobs
    wait_until(lambda: client.get_rollout(job_id).status is JobStatus.run, 30, "the job to run")
    for name in [n for n in stack.worker_names if n.startswith("worker-run")]:
        stack.kill_worker(name, signal.SIGKILL)
    replacement = stack.start_worker("run", 2)
    stack.wait_worker(replacement)
    results = list(client.iter_batch_results(accepted.batch_id))
    assert [t.job_id for t in results] == [job_id]
    assert results[0].status is JobStatus.completed
    assert results[0].reward == 1.0
    r = redis.Redis.from_url(stack.redis_url)
    assert r.xlen(f"rs:batch:{accepted.batch_id}:done") == 1
    progress = client.batch_progress(accepted.batch_id)
    assert (progress.finished, progress.counts.get("completed")) == (1, 1)
    assert all(b.in_flight == 0 for b in client.list_backends())


def test_a_failing_job_does_not_fail_its_batch(client: RolloutClient) -> None:
    accepted = client.submit_batch([REFUSED, FAST], group_size=1, sampling={"seed": 0})
    results = {t.instance_id: t for t in client.iter_batch_results(accepted.batch_id)}
    refused, fast = results["refused"], results["fast-add"]
    assert refused.status is JobStatus.failed
    assert refused.error is not None
    assert (refused.error.stage, refused.error.type) == ("run", "BackendError")
    assert refused.reward is None
    assert fast.status is JobStatus.completed and fast.reward == 1.0
    progress = client.batch_progress(accepted.batch_id)
    assert progress.done and progress.counts == {"completed": 1, "failed": 1, "pending": 0}
    assert all(b.in_flight == 0 for b in client.list_backends())


def test_a_transient_backend_error_is_retried(client: RolloutClient) -> None:
    traj = client.submit_rollout(FLAKY, sampling={"seed": 0}, wait=True, timeout=60)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed and traj.reward == 1.0


def test_a_job_past_its_run_time_limit_is_timed_out_with_its_backend_freed(
    client: RolloutClient,
) -> None:
    traj = client.submit_rollout(GLACIAL, sampling={"seed": 0}, wait=True, timeout=60)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.timed_out
    assert traj.error is not None and (traj.error.stage, traj.error.type) == ("run", "timeout")
    assert traj.timing.run is None or traj.timing.run < 30
    assert all(b.in_flight == 0 for b in client.list_backends())


def pool_processes(worker_pid: int) -> list[int]:
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(pid) for pid in children]


@pytest.mark.run_pool("prefork")
def test_killed_pool_process_is_replaced_and_its_job_requeued(
    client: RolloutClient, stack: Stack
) -> None:
    accepted = client.submit_batch([PATIENT], group_size=1, sampling={"seed": 0})
    [job_id] = accepted.jobs
    wait_until(lambda: client.get_rollout(job_id).status is JobStatus.run, 30, "the job to run")
    [run_worker] = [n for n in stack.worker_names if n.startswith("worker-run")]
    for pid in pool_processes(stack.children[run_worker].pid):
        os.kill(pid, signal.SIGKILL)
    results = list(client.iter_batch_results(accepted.batch_id))
    assert [(t.job_id, t.status, t.reward) for t in results] == [(job_id, JobStatus.completed, 1.0)]
    r = redis.Redis.from_url(stack.redis_url)
    assert r.xlen(f"rs:batch:{accepted.batch_id}:done") == 1


def backend_queue(url: str, api_key: str) -> float:
    """Requests the development server holds now (waiting on their delay, or running)."""
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    total = 0.0
    for line in answer.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.run_pool("jobs")
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
