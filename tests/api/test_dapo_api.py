"""`dynamic_sampling` through the gateway over real HTTP on a real Redis, without workers: bad
options are refused naming the field with nothing written, good ones draw the first groups."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis

from tests.support.gateway import field_locs, snapshot


def task(i: int) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": f"q{i}",
        "problem": f"{i}+{i}?",
        "answer": str(2 * i),
    }


POOL = [task(i) for i in range(5)]


def body(dynamic: Any, **extra: Any) -> dict[str, Any]:
    return {"tasks": POOL, "dynamic_sampling": dynamic, **extra}


DS = "body.dynamic_sampling."
G2 = {"group_size": 2}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("group of one by default", body({"target_groups": 2}), "body.group_size"),
    ("group of one given", body({"target_groups": 2, "group_size": 1}), DS + "group_size"),
    ("sizes disagree", body({"target_groups": 2, "group_size": 4}, **G2), DS + "group_size"),
    ("no target", body({"group_size": 2}), DS + "target_groups"),
    ("zero target", body({"target_groups": 0}, **G2), DS + "target_groups"),
    ("target beyond the pool", body({"target_groups": 6}, **G2), DS + "target_groups"),
    (
        "no groups in flight",
        body({"target_groups": 2, "max_inflight_groups": 0}, **G2),
        DS + "max_inflight_groups",
    ),
    (
        "no attempts",
        body({"target_groups": 2, "max_attempts_per_task": 0}, **G2),
        DS + "max_attempts_per_task",
    ),
    ("not a flag", body({"target_groups": 2, "early_cancel": "maybe"}, **G2), DS + "early_cancel"),
    ("misspelt option", body({"target_groups": 2, "targets": 3}, **G2), DS + "targets"),
    (
        "a bad task in the pool",
        {"tasks": [*POOL, {"data_source": "math"}], **G2, "dynamic_sampling": {"target_groups": 1}},
        "body.tasks.5.problem",
    ),
]


@pytest.mark.parametrize(("case", "request_body", "loc"), BAD, ids=[c[0] for c in BAD])
def test_bad_dynamic_sampling_is_422_naming_the_field_and_writes_nothing(
    http: httpx.Client,
    with_backend: None,
    redis_client: redis.Redis,
    case: str,
    request_body: dict[str, Any],
    loc: str,
) -> None:
    before = snapshot(redis_client)
    answer = http.post("/v1/batches", json=request_body)
    assert answer.status_code == 422, (case, answer.text)
    assert loc in field_locs(answer), (case, answer.json())
    assert snapshot(redis_client) == before


def test_without_a_backend_nothing_is_written(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)
    answer = http.post("/v1/batches", json=body({"target_groups": 2}, group_size=2))
    assert answer.status_code == 503
    assert snapshot(redis_client) == before


def test_the_first_groups_are_drawn_and_queued(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    dynamic = {
        "target_groups": 2,
        "group_size": 3,
        "max_inflight_groups": 2,
        "max_attempts_per_task": 2,
    }
    answer = http.post("/v1/batches", json={**body(dynamic), "sampling": {"seed": 7}})
    assert answer.status_code == 202, answer.text
    accepted = answer.json()
    batch_id = accepted["batch_id"]
    assert accepted["jobs"] == [f"{batch_id}-{g}-{i}" for g in (1, 2) for i in range(3)]
    assert redis_client.llen("init") == 6
    job = http.get(f"/v1/rollouts/{batch_id}-2-2").json()
    assert (job["instance_id"], job["sample_index"], job["status"]) == ("q1", 2, "queued")
    assert json.loads(redis_client.hget(f"rs:job:{batch_id}-2-2", "sampling") or "")["seed"] == 7
    progress = http.get(f"/v1/batches/{batch_id}").json()
    assert (progress["total"], progress["group_size"], progress["done"]) == (6, 3, False)
    dyn = progress["dynamic"]
    assert (dyn["state"], dyn["target_groups"], dyn["max_inflight_groups"]) == ("running", 2, 2)
    assert (dyn["groups_drawn"], dyn["groups_in_flight"]) == (2, 2)
    assert dyn["tasks_never_drawn"] == [2, 3, 4]
    assert dyn["early_cancel"] is True and dyn["max_attempts_per_task"] == 2


def test_cancelling_a_dynamic_batch_stops_drawing_and_ends_its_stream(
    http: httpx.Client, with_backend: None
) -> None:
    dynamic = {"target_groups": 2, "max_inflight_groups": 3}
    batch_id = http.post("/v1/batches", json=body(dynamic, group_size=2)).json()["batch_id"]
    cancelled = http.delete(f"/v1/batches/{batch_id}").json()
    assert cancelled["done"] is True
    assert cancelled["counts"] == {"cancelled": 6, "pending": 0}
    dyn = cancelled["dynamic"]
    assert (dyn["state"], dyn["groups_cancelled"], dyn["groups_drawn"]) == ("done", 3, 3)
    assert (dyn["rollouts_wasted"], dyn["rollout_seconds_wasted"]) == (0, 0.0)  # none started
    assert dyn["tasks_never_drawn"] == [3, 4]
    assert [
        line for line in http.get(f"/v1/batches/{batch_id}/results").text.splitlines() if line
    ] == []
    again = http.delete(f"/v1/batches/{batch_id}").json()
    assert again["dynamic"]["groups_drawn"] == 3 and again["done"] is True


def test_the_client_sends_dynamic_sampling(http: httpx.Client, with_backend: None) -> None:
    from api.client import RolloutClient
    from core.schemas import DynamicSampling

    with RolloutClient(str(http.base_url)) as client:
        accepted = client.submit_batch(
            POOL,
            group_size=2,
            dynamic_sampling=DynamicSampling(target_groups=1, max_inflight_groups=1),
        )
        assert len(accepted.jobs) == 2
        progress = client.batch_progress(accepted.batch_id)
        assert progress.dynamic is not None and progress.dynamic.groups_drawn == 1
        assert client.cancel_batch(accepted.batch_id).done
