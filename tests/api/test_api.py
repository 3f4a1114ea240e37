"""The gateway over real HTTP on a real Redis: bad input is refused and leaves Redis as it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from api.app import create_app
from broker.processes import free_port
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, field_locs, serve, snapshot
from workers.boxreport import node_report, publish

TOKEN = "s3cret-token"
LIMIT = 64 * 1024
GATEWAY_SETTINGS = {"max_body_bytes": LIMIT}


G = GOOD_TASK
BAD_ROLLOUTS: list[tuple[str, Any, str]] = [
    ("missing task", {"sampling": {}}, "body.task"),
    ("missing data_source", {"task": {"problem": "x"}}, "body.task.data_source"),
    ("negative temperature", {"task": G, "sampling": {"temperature": -1}}, "body.sampling"),
    ("zero max_tokens", {"task": G, "sampling": {"max_tokens": 0}}, "body.sampling.max_tokens"),
    ("misspelt field", {"task": G, "sampling": {"temprature": 1}}, "body.sampling.temprature"),
    ("zero max_turns", {"task": G, "agent": {"max_turns": 0}}, "body.agent.max_turns"),
    ("math without problem", {"task": {"data_source": "math", "answer": "4"}}, "body.task"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "loc"), BAD_ROLLOUTS, ids=[c[0] for c in BAD_ROLLOUTS])
def test_malformed_rollout_is_422_naming_the_field_and_changes_nothing(
    http: httpx.Client,
    with_backend: None,
    redis_client: redis.Redis,
    case: str,
    body: Any,
    loc: str,
) -> None:
    before = snapshot(redis_client)
    answer = http.post("/v1/rollouts", json=body)
    assert answer.status_code == 422, answer.text
    assert any(found.startswith(loc) for found in field_locs(answer)), (case, answer.json())
    assert snapshot(redis_client) == before


def test_body_that_is_not_json_is_422(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)
    answer = http.post(
        "/v1/rollouts", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422
    assert snapshot(redis_client) == before


def test_unknown_data_source_lists_the_known_ones(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)
    answer = http.post("/v1/rollouts", json={"task": {"data_source": "chess", "fen": "x"}})
    assert answer.status_code == 422
    [item] = answer.json()["detail"]
    assert item["loc"] == ["body", "task", "data_source"]
    assert "'chess'" in item["msg"] and "math" in item["msg"] and "stem" in item["msg"]
    assert snapshot(redis_client) == before


def test_batch_with_one_bad_task_names_it_and_enqueues_nothing(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)
    body = {"tasks": [GOOD_TASK, GOOD_TASK, {"data_source": "stem"}], "group_size": 4}
    answer = http.post("/v1/batches", json=body)
    assert answer.status_code == 422
    assert any(loc.startswith("body.tasks.2") for loc in field_locs(answer)), answer.json()
    assert snapshot(redis_client) == before


def test_dynamic_sampling_that_cannot_work_is_refused(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    # more cases in tests/test_dapo_api.py
    before = snapshot(redis_client)
    body = {"tasks": [GOOD_TASK], "group_size": 2, "dynamic_sampling": {"target_groups": 2}}
    answer = http.post("/v1/batches", json=body)
    assert answer.status_code == 422
    assert field_locs(answer) == ["body.dynamic_sampling.target_groups"]
    assert snapshot(redis_client) == before


def test_oversized_body_is_413(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)
    task = {**GOOD_TASK, "problem": "x" * (LIMIT + 1)}
    answer = http.post("/v1/rollouts", json={"task": task})
    assert answer.status_code == 413
    assert str(LIMIT) in answer.json()["detail"]
    assert snapshot(redis_client) == before


def test_oversized_chunked_body_is_413(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    before = snapshot(redis_client)

    def chunks() -> Iterator[bytes]:
        yield b'{"task": {"data_source": "math", "problem": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}}'

    answer = http.post(
        "/v1/rollouts", content=chunks(), headers={"content-type": "application/json"}
    )
    assert answer.status_code == 413
    assert snapshot(redis_client) == before


def test_no_backend_registered_is_503(http: httpx.Client, redis_client: redis.Redis) -> None:
    before = snapshot(redis_client)
    answer = http.post("/v1/rollouts", json={"task": GOOD_TASK})
    assert answer.status_code == 503
    assert "no inference backend" in answer.json()["detail"]
    assert snapshot(redis_client) == before


def test_accepted_rollout_is_queued_with_defaults_resolved(
    http: httpx.Client, with_backend: None, redis_client: redis.Redis
) -> None:
    answer = http.post("/v1/rollouts", json={"task": GOOD_TASK})
    assert answer.status_code == 202
    job_id = answer.json()["job_id"]
    record = redis_client.hgetall(f"rs:job:{job_id}")
    assert record["status"] == "queued"
    assert '"max_tokens": 1024' in record["sampling"]
    assert redis_client.llen("init") == 1
    got = http.get(f"/v1/rollouts/{job_id}").json()
    assert got["status"] == "queued" and got["instance_id"].startswith("math-")


def test_cancelling_a_queued_job_records_it_cancelled(
    http: httpx.Client, with_backend: None
) -> None:
    job_id = http.post("/v1/rollouts", json={"task": GOOD_TASK}).json()["job_id"]
    answer = http.delete(f"/v1/rollouts/{job_id}")
    assert answer.status_code == 200
    body = answer.json()
    assert body["status"] == "cancelled"
    assert body["error"] == {
        "stage": "queued",
        "type": "cancelled",
        "message": "cancelled by request",
    }
    again = http.delete(f"/v1/rollouts/{job_id}").json()
    assert again["status"] == "cancelled"


def test_batch_progress_and_cancel(http: httpx.Client, with_backend: None) -> None:
    accepted = http.post("/v1/batches", json={"tasks": [GOOD_TASK] * 2, "group_size": 3}).json()
    assert len(accepted["jobs"]) == 6
    progress = http.get(f"/v1/batches/{accepted['batch_id']}").json()
    assert (progress["total"], progress["groups_total"], progress["done"]) == (6, 2, False)
    cancelled = http.delete(f"/v1/batches/{accepted['batch_id']}").json()
    assert cancelled["counts"] == {"cancelled": 6, "pending": 0}
    assert cancelled["done"] is True
    lines = http.get(f"/v1/batches/{accepted['batch_id']}/results").text.splitlines()
    assert sorted(line for line in lines if line) != []
    assert len([line for line in lines if line.strip()]) == 6


def test_unknown_ids_are_404(http: httpx.Client) -> None:
    assert http.get("/v1/rollouts/nope").status_code == 404
    assert http.get("/v1/batches/nope").status_code == 404
    assert http.get("/v1/batches/nope/results").status_code == 404
    assert http.delete("/v1/backends/nope").status_code == 404


def test_backend_that_does_not_answer_is_refused(http: httpx.Client) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    answer = http.post("/v1/backends", json={"url": url, "model": "m"})
    assert answer.status_code == 422
    assert url in answer.json()["detail"][0]["msg"]
    assert http.get("/v1/backends").json() == []


def test_backends_register_list_remove(http: httpx.Client) -> None:
    spec = {"url": "http://localhost:8000", "model": "qwen", "policy_version": 3}
    created = http.post("/v1/backends?verify=false", json=spec).json()
    assert created["kind"] == "vllm" and created["policy_version"] == 3
    listed = http.get("/v1/backends").json()
    assert [b["id"] for b in listed] == [created["id"]]
    assert http.delete(f"/v1/backends/{created['id']}").status_code == 204
    assert http.get("/v1/backends").json() == []


def test_sglang_backends_register_and_api_is_vllm_only(http: httpx.Client) -> None:
    spec = {"url": "http://localhost:30000", "model": "qwen", "kind": "sglang", "capacity": 2}
    created = http.post("/v1/backends?verify=false", json=spec).json()
    assert created["kind"] == "sglang" and created["capacity"] == 2.0
    assert created["state"] == "healthy" and created["idle"] is True
    wrong = http.post("/v1/backends?verify=false", json={**spec, "api": "generate"})
    assert wrong.status_code == 422 and field_locs(wrong) == ["body.api"]
    bad = http.post("/v1/backends?verify=false", json={**spec, "capacity": 0})
    assert bad.status_code == 422 and field_locs(bad) == ["body.capacity"]
    vllm = {"url": "http://localhost:8000", "model": "qwen", "tokenizer": "/models/qwen"}
    refused = http.post("/v1/backends?verify=false", json=vllm)
    assert refused.status_code == 422 and field_locs(refused) == ["body.tokenizer"]
    hub = http.post("/v1/backends?verify=false", json={**spec, "tokenizer": "Qwen/Qwen3-8B"})
    assert hub.json()["tokenizer"] == "Qwen/Qwen3-8B"
    outside = http.post("/v1/backends?verify=false", json={**spec, "tokenizer": "/models/qwen"})
    assert outside.status_code == 422 and field_locs(outside) == ["body.tokenizer"]


def test_drain_and_resume_one_and_all(http: httpx.Client, gateway: str) -> None:
    for name in ("a", "b"):
        spec = {"url": "http://localhost:8000", "model": "qwen", "id": name}
        assert http.post("/v1/backends?verify=false", json=spec).status_code == 201
    drained = http.post("/v1/backends/a/drain").json()
    assert drained["state"] == "draining" and drained["idle"] is True
    assert http.get("/v1/backends/a").json()["state"] == "draining"
    resumed = http.post("/v1/backends/a/resume", json={"policy_version": 4}).json()
    assert resumed["state"] == "healthy" and resumed["policy_version"] == 4
    assert [b["state"] for b in http.post("/v1/backends/drain?wait=1").json()] == [
        "draining",
        "draining",
    ]
    after = http.post("/v1/backends/resume", json={"policy_version": 5}).json()
    assert [(b["state"], b["policy_version"]) for b in after] == [("healthy", 5)] * 2
    assert http.post("/v1/backends/resume").status_code == 200  # the body is optional
    for path in ("/v1/backends/nope/drain", "/v1/backends/nope/resume"):
        missing = http.post(path)
        assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    assert http.get("/v1/backends/nope").status_code == 404
    bad = http.post("/v1/backends/a/resume", json={"policy_version": "x"})
    assert bad.status_code == 422 and field_locs(bad) == ["body.policy_version"]
    assert http.post("/v1/backends/a/drain?wait=-1").status_code == 422


def test_drain_with_wait_answers_once_idle(http: httpx.Client, redis_client: redis.Redis) -> None:
    from routing.pool import BackendPool

    spec = {"url": "http://127.0.0.1:1", "model": "m", "id": "a"}
    http.post("/v1/backends?verify=false", json=spec)
    pool = BackendPool(redis_client)
    pool.acquire("job-1")
    held = http.post("/v1/backends/a/drain?wait=0.2").json()
    assert held["state"] == "draining" and held["idle"] is False and held["in_flight"] == 1
    pool.request_done("job-1")  # its running request ended: it lets go of the drained backend
    assert http.post("/v1/backends/a/drain?wait=5").json()["idle"] is True


def test_health_stats_and_metrics(http: httpx.Client, with_backend: None) -> None:
    assert http.get("/healthz").json() == {"status": "ok", "redis": True, "backends": 1}
    http.post("/v1/rollouts", json={"task": GOOD_TASK})
    stats = http.get("/v1/stats").json()
    assert stats["queues"]["init"] == 1
    assert stats["jobs"]["queued"] == 1
    assert stats["backends"] == {"b0": 0}
    text = http.get("/metrics").text
    assert 'rollserve_jobs{status="queued"} 1.0' in text
    assert 'rollserve_queue_depth{queue="init"} 1.0' in text
    assert 'rollserve_backend_in_flight{backend="b0"} 0.0' in text
    assert 'rollserve_backend_state{backend="b0",state="healthy"} 1.0' in text
    assert 'rollserve_backend_state{backend="b0",state="dead"} 0.0' in text
    assert 'rollserve_stage_duration_seconds_bucket{le="+Inf",stage="run"} 0.0' in text


def test_stats_show_which_sandbox_limits_each_node_enforces(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    assert http.get("/v1/stats").json()["sandbox_limits"] is None  # no worker reported yet
    report = node_report("bwrap")
    publish(redis_client, Settings().key_prefix, "node-a", report)
    shown = http.get("/v1/stats").json()["sandbox_limits"]
    assert shown == {"node-a": report}
    assert set(shown["node-a"]) == {"memory", "pids", "cpu", "disk", "inodes"}


def test_openapi_is_served(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/rollouts", "/v1/batches", "/v1/backends", "/v1/stats", "/healthz"} <= set(paths)


def test_token_is_required_when_configured(redis_url: str) -> None:
    app = create_app(Settings(redis_url=redis_url, api_token=TOKEN))
    with serve(app) as url, httpx.Client(base_url=url) as http:
        assert http.get("/v1/backends").status_code == 401
        wrong = http.get("/v1/backends", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = http.get("/v1/backends", headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.status_code == 200
        assert http.get("/healthz").status_code == 200
