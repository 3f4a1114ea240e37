"""Cursors of `GET /v1/batches/{id}/results` over real HTTP on a real Redis, without workers:
every line carries one, `?after=` resumes right after its line with nothing repeated or
skipped (also while results keep arriving, and for dynamic batches), bad cursors are refused
naming `after`. Jobs are ended through the job store, as a worker would end them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from broker.jobstore import JobStore
from core.schemas import JobStatus, Trajectory
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, field_locs


@pytest.fixture
def store(redis_url: str) -> Iterator[JobStore]:
    client = redis.Redis.from_url(redis_url)
    yield JobStore(client, Settings().key_prefix)
    client.close()


def submit(http: httpx.Client, tasks: int, group_size: int = 1) -> tuple[str, list[str]]:
    answer = http.post("/v1/batches", json={"tasks": [GOOD_TASK] * tasks, "group_size": group_size})
    assert answer.status_code == 202, answer.text
    return answer.json()["batch_id"], answer.json()["jobs"]


def end(store: JobStore, job_id: str, reward: float = 1.0) -> None:
    store.transition(job_id, JobStatus.init)
    trajectory = store.trajectory(job_id)
    trajectory.reward = reward
    assert store.finish(job_id, JobStatus.completed, trajectory)


def lines(http: httpx.Client, batch_id: str, after: str | None = None) -> list[dict[str, Any]]:
    """The stream's result lines as JSON (it ends only when the batch has no more)."""
    params = {} if after is None else {"after": after}
    answer = http.get(f"/v1/batches/{batch_id}/results", params=params)
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line.strip()]


def test_every_line_has_a_cursor_and_after_resumes_right_after_it(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    batch_id, jobs = submit(http, 3, group_size=2)
    order = [jobs[4], jobs[0], jobs[5], jobs[2], jobs[1], jobs[3]]
    for job_id in order:
        end(store, job_id)
    full = lines(http, batch_id)
    assert [line["job_id"] for line in full] == order
    cursors = [line["cursor"] for line in full]
    assert all(isinstance(c, str) and c for c in cursors) and len(set(cursors)) == len(order)
    for line in full:  # the rest of the line is the trajectory as before
        assert Trajectory.model_validate(line).status is JobStatus.completed
    for i, cursor in enumerate(cursors):
        assert lines(http, batch_id, after=cursor) == full[i + 1 :]
    assert lines(http, batch_id) == full  # the same cursors for every reader


def test_resuming_while_results_arrive_repeats_and_skips_nothing(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    batch_id, jobs = submit(http, 9)
    for job_id in jobs[:3]:
        end(store, job_id)
    seen: list[dict[str, Any]] = []
    with http.stream("GET", f"/v1/batches/{batch_id}/results") as answer:
        for raw in answer.iter_lines():
            if raw.strip():
                seen.append(json.loads(raw))
            if len(seen) == 2:
                break  # the client goes away after two lines
    for job_id in jobs[3:5]:
        end(store, job_id)
    later = threading.Thread(target=lambda: [end(store, j) for j in jobs[5:]])
    with http.stream(
        "GET", f"/v1/batches/{batch_id}/results", params={"after": seen[-1]["cursor"]}
    ) as answer:
        later.start()
        for raw in answer.iter_lines():
            if raw.strip():
                seen.append(json.loads(raw))
    later.join()
    assert [line["job_id"] for line in seen] == jobs
    assert len({line["cursor"] for line in seen}) == len(jobs)


def test_dynamic_batches_stream_cursors_too(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    tasks = [{**GOOD_TASK, "instance_id": f"q{i}"} for i in range(2)]
    dynamic = {"target_groups": 2, "max_inflight_groups": 2, "early_cancel": False}
    answer = http.post(
        "/v1/batches", json={"tasks": tasks, "group_size": 2, "dynamic_sampling": dynamic}
    )
    assert answer.status_code == 202, answer.text
    batch_id, jobs = answer.json()["batch_id"], answer.json()["jobs"]
    end(store, jobs[0], 0.0)
    end(store, jobs[1], 1.0)  # the first group is accepted
    first = []
    with http.stream("GET", f"/v1/batches/{batch_id}/results") as stream:
        for raw in stream.iter_lines():
            if raw.strip():
                first.append(json.loads(raw))
            if len(first) == 2:
                break
    end(store, jobs[2], 1.0)
    end(store, jobs[3], 0.0)  # the second: the target is met and the batch is done
    full = lines(http, batch_id)
    assert [line["job_id"] for line in full] == jobs
    assert full[:2] == first
    assert lines(http, batch_id, after=first[-1]["cursor"]) == full[2:]
    assert lines(http, batch_id, after=full[-1]["cursor"]) == []


def test_bad_cursors_are_refused_naming_after(
    http: httpx.Client, with_backend: None, store: JobStore
) -> None:
    batch_id, jobs = submit(http, 2)
    other_id, other_jobs = submit(http, 1)
    for job_id in [*jobs, *other_jobs]:
        end(store, job_id)
    cursor = lines(http, batch_id)[0]["cursor"]
    [foreign] = [x["cursor"] for x in lines(http, other_id)]
    entry, tag = cursor.rsplit(".", 1)
    ms, seq = entry.split("-")
    bad = {
        "not a cursor": "nope",
        "empty": "",
        "another batch's": foreign,
        "a line that never was": f"{ms}-{int(seq) + 7}.{tag}",
        "past the stream id range": f"{2**64}-0.{tag}",
        "too long": "1" * 200,
    }
    for why, after in bad.items():
        answer = http.get(f"/v1/batches/{batch_id}/results", params={"after": after})
        assert answer.status_code == 422, (why, answer.text)
        assert field_locs(answer) == ["query.after"], why
    refused = http.get(f"/v1/batches/{batch_id}/results", params={"after": foreign})
    assert "another batch" in refused.json()["detail"][0]["msg"]
    assert http.get("/v1/batches/nope/results", params={"after": cursor}).status_code == 404
