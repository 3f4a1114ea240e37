"""Finished trajectories leave Redis once delivered and are still served from the results
store: over real HTTP on a real Redis, without workers (jobs are saved turn by turn and ended
through the job store, as a worker would)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from broker.jobstore import JobStore
from core.schemas import JobStatus
from core.settings import Settings
from tests.support.gateway import GOOD_TASK
from workers.trajectory import TrajectoryBuilder

STUB_TTL = Settings().results_stub_ttl


@pytest.fixture
def store(redis_url: str) -> Iterator[JobStore]:
    """The job store as a worker has it (the gateway's settings, so its results store)."""
    client = redis.Redis.from_url(redis_url)
    yield JobStore(client, Settings().key_prefix)
    client.close()


def run_and_end(store: JobStore, job_id: str, turns: int = 2) -> TrajectoryBuilder:
    store.transition(job_id, JobStatus.run)
    builder = TrajectoryBuilder([1, 2, 3])
    trajectory = store.trajectory(job_id)
    for turn in range(turns):
        builder.add_model_turn([10 + turn, 20 + turn], [-0.5, -0.25], f"t{turn}", "stop", 0.1)
        store.save_partial(job_id, builder.fill(trajectory))
        builder.add_env_turn([30 + turn], f"r{turn}")
        store.save_partial(job_id, builder.fill(trajectory))
    trajectory.reward = 1.0
    assert store.finish(job_id, JobStatus.completed, trajectory)
    return builder


def stub_ttl(store: JobStore, job_id: str) -> int:
    return int(store.r.ttl(store.job_key(job_id)))


def submit_batch(http: httpx.Client, tasks: int) -> tuple[str, list[str]]:
    answer = http.post("/v1/batches", json={"tasks": [GOOD_TASK] * tasks, "group_size": 1})
    assert answer.status_code == 202, answer.text
    return answer.json()["batch_id"], answer.json()["jobs"]


def stream(http: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    with http.stream("GET", f"/v1/batches/{batch_id}/results") as answer:
        assert answer.status_code == 200
        return [json.loads(line) for line in answer.iter_lines() if line.strip()]


def test_a_finished_rollout_is_served_from_the_results_store_and_then_leaves_redis(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    answer = http.post("/v1/rollouts", json={"task": GOOD_TASK})
    job_id = answer.json()["job_id"]
    builder = run_and_end(store, job_id)
    assert store.get(job_id).result is not None  # Redis keeps only the record
    assert stub_ttl(store, job_id) > STUB_TTL
    got = http.get(f"/v1/rollouts/{job_id}")
    assert got.status_code == 200
    body = got.json()
    assert (body["status"], body["reward"]) == ("completed", 1.0)
    assert body["response_ids"] == builder.response_ids
    assert body["loss_mask"] == builder.loss_mask
    assert 0 < stub_ttl(store, job_id) <= STUB_TTL  # delivered: the stub goes soon
    store.r.delete(store.job_key(job_id))  # ... and once it has gone
    again = http.get(f"/v1/rollouts/{job_id}")
    assert again.status_code == 200
    assert again.json()["response_ids"] == builder.response_ids


def test_a_running_rollout_read_keeps_its_record(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    job_id = http.post("/v1/rollouts", json={"task": GOOD_TASK}).json()["job_id"]
    store.transition(job_id, JobStatus.run)
    assert http.get(f"/v1/rollouts/{job_id}").json()["status"] == "run"
    assert stub_ttl(store, job_id) > STUB_TTL


def test_streamed_results_are_delivered_and_stream_again_from_the_results_store(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    batch_id, jobs = submit_batch(http, 3)
    built = {job_id: run_and_end(store, job_id, turns=1 + i) for i, job_id in enumerate(jobs)}
    first = stream(http, batch_id)
    assert [line["job_id"] for line in first] == jobs
    for line in first:
        assert line["response_ids"] == built[line["job_id"]].response_ids
    # each line was taken before the stream went on (the last one, before it ended)
    assert all(0 < stub_ttl(store, job_id) <= STUB_TTL for job_id in jobs)
    for job_id in jobs:
        store.r.delete(store.job_key(job_id))  # the stubs expired
    assert stream(http, batch_id) == first


def test_a_trajectory_of_two_segments_streams_with_its_segments(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    batch_id, (job_id,) = submit_batch(http, 1)
    store.transition(job_id, JobStatus.run)
    builder = TrajectoryBuilder([1, 2, 3])
    trajectory = store.trajectory(job_id)
    builder.add_model_turn([10, 11], [-0.5, -0.25], "t0", "stop", 0.1, policy_version=1)
    store.save_partial(job_id, builder.fill(trajectory))
    builder.start_segment([1, 2, 3, 40], "history_changed")  # the harness edited its history
    builder.add_model_turn([12], [-1.0], "t1", "stop", 0.1, policy_version=2)
    builder.add_env_turn([30], "r1")
    builder.add_model_turn([13], [-0.125], "t2", "stop", 0.1, policy_version=2)
    store.save_partial(job_id, builder.fill(trajectory))
    trajectory.reward = 1.0
    assert store.finish(job_id, JobStatus.completed, trajectory)
    (line,) = stream(http, batch_id)
    assert (line["prompt_ids"], line["response_ids"]) == ([1, 2, 3], [10, 11])
    assert line["loss_mask"] == [1, 1] and line["logprobs"] == [-0.5, -0.25]
    assert line["segments"] == [
        {
            "reason": "history_changed",
            "first_turn": 1,
            "prompt_ids": [1, 2, 3, 40],
            "response_ids": [12, 30, 13],
            "loss_mask": [1, 0, 1],
            "logprobs": [-1.0, None, -0.125],
            "policy_versions": [2, 2],
        }
    ]
    assert line["turns"][1]["segment_start"] == "history_changed"
