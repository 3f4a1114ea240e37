"""The submission path under load and at its limits: concurrent clients never lock the gateway,
a saturated broker answers 503 with nothing kept, and the per-request, per-task and per-tenant
limits refuse what is too big before anything is written."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from api.app import create_app
from core.settings import Settings
from tests.support.gateway import serve

TASK = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}
TOKEN = "tenant-a-token"


def make_gateway(redis_url: str, **settings: Any) -> Any:
    return create_app(Settings(redis_url=redis_url, **settings))


def register_backend(client: httpx.Client) -> None:
    answer = client.post(
        "/v1/backends?verify=false", json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"}
    )
    assert answer.status_code == 201, answer.text


def queued_messages(r: redis.Redis, queue: str = "init") -> int:
    return int(r.llen(queue))


def test_64_concurrent_batch_submissions_are_all_accepted_and_sent(
    gateway: str, with_backend: None, redis_client: redis.Redis
) -> None:
    clients, tasks, group = 64, 20, 2

    def submit(n: int) -> tuple[int, int]:
        body = {
            "tasks": [{**TASK, "instance_id": f"c{n}-t{i}"} for i in range(tasks)],
            "group_size": group,
        }
        with httpx.Client(base_url=gateway, timeout=120) as client:
            answer = client.post("/v1/batches", json=body)
        return answer.status_code, len(answer.json().get("jobs", []))

    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(submit, range(clients)))
    assert results == [(202, tasks * group)] * clients
    # Every accepted job's chain is in the broker: one INIT message per job.
    assert queued_messages(redis_client) == clients * tasks * group
    assert int(redis_client.hget("rs:counts", "queued") or 0) == clients * tasks * group
    # ... and the gateway still answers.
    with httpx.Client(base_url=gateway, timeout=10) as client:
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/batches", json={"tasks": [TASK]}).status_code == 202


def test_a_saturated_broker_answers_503_and_keeps_nothing(redis_url: str) -> None:
    app = make_gateway(redis_url, broker_send_timeout=0.3)
    svc = app.state.services
    r = redis.Redis.from_url(redis_url)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        register_backend(client)
        before = sorted(r.keys("*"))
        pool = svc.celery.pool
        held = [pool.acquire(block=True, timeout=5) for _ in range(pool.limit)]
        try:
            answer = client.post("/v1/batches", json={"tasks": [TASK, TASK], "group_size": 2})
        finally:
            for connection in held:
                connection.release()
        assert answer.status_code == 503, answer.text
        assert "saturated" in answer.text and "ROLLSERVE_BROKER_SEND_TIMEOUT" in answer.text
        # Nothing of the batch is left: no record, no message, no count.
        assert sorted(k for k in r.keys("*") if k != b"rs:counts") == before
        assert int(r.hget("rs:counts", "queued") or 0) == 0
        assert queued_messages(r) == 0
        # Once producers are free again, submissions go through.
        assert client.post("/v1/batches", json={"tasks": [TASK]}).status_code == 202
        assert queued_messages(r) == 1
    r.close()


def test_a_batch_too_many_jobs_is_413_naming_the_field(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with (
        serve(make_gateway(redis_url, max_jobs_per_request=10)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        register_backend(client)
        before = sorted(r.keys("*"))
        answer = client.post("/v1/batches", json={"tasks": [TASK] * 3, "group_size": 4})
        assert answer.status_code == 413, answer.text
        detail = answer.json()["detail"][0]
        assert detail["loc"] == ["body", "tasks"]
        assert "12 jobs" in detail["msg"] and "ROLLSERVE_MAX_JOBS_PER_REQUEST" in detail["msg"]
        dynamic = {
            "tasks": [TASK] * 40,
            "group_size": 4,
            "dynamic_sampling": {"target_groups": 5, "max_inflight_groups": 3},
        }
        answer = client.post("/v1/batches", json=dynamic)
        assert answer.status_code == 413, answer.text
        assert answer.json()["detail"][0]["loc"] == [
            "body",
            "dynamic_sampling",
            "max_inflight_groups",
        ]
        assert sorted(r.keys("*")) == before
        # At the limit it is accepted.
        ok = client.post("/v1/batches", json={"tasks": [TASK] * 5, "group_size": 2})
        assert ok.status_code == 202, ok.text
    r.close()


def test_a_task_over_the_byte_limit_is_413_naming_it(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with (
        serve(make_gateway(redis_url, max_task_bytes=2000)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        register_backend(client)
        before = sorted(r.keys("*"))
        big = {**TASK, "problem": "x" * 5000}
        answer = client.post("/v1/batches", json={"tasks": [TASK, big]})
        assert answer.status_code == 413, answer.text
        detail = answer.json()["detail"][0]
        assert detail["loc"] == ["body", "tasks", 1]
        assert "ROLLSERVE_MAX_TASK_BYTES" in detail["msg"]
        answer = client.post("/v1/rollouts", json={"task": big})
        assert answer.status_code == 413
        assert answer.json()["detail"][0]["loc"] == ["body", "task"]
        assert sorted(r.keys("*")) == before
    r.close()


def test_a_batch_task_is_stored_once_per_group(redis_url: str) -> None:
    app = make_gateway(redis_url)
    store = app.state.services.store
    problem = "What is 2+2? " + "pad " * 2000
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        register_backend(client)
        answer = client.post(
            "/v1/batches", json={"tasks": [{**TASK, "problem": problem}], "group_size": 16}
        )
    assert answer.status_code == 202
    copies = sum(
        problem.encode() in v
        for key in store.r.keys("rs:*")
        for v in _values(store.r, key)
        if isinstance(v, bytes)
    )
    assert copies == 1
    for job_id in answer.json()["jobs"]:
        assert store.get(job_id).task["problem"] == problem


def _values(r: redis.Redis, key: str) -> list[Any]:
    kind = r.type(key)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    if kind == "hash":
        return list(r.hgetall(key).values())
    if kind == "string":
        return [r.get(key)]
    if kind == "list":
        return list(r.lrange(key, 0, -1))
    return []


def test_unfinished_jobs_per_tenant_are_capped_with_429(redis_url: str) -> None:
    app = make_gateway(redis_url, max_queued_jobs=6, api_token=TOKEN)
    store = app.state.services.store
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = redis.Redis.from_url(redis_url)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        register_backend(client)
        first = client.post("/v1/batches", json={"tasks": [TASK] * 2, "group_size": 2})
        assert first.status_code == 202
        before = sorted(r.keys("*"))
        over = client.post("/v1/batches", json={"tasks": [TASK] * 3})
        assert over.status_code == 429, over.text
        assert "ROLLSERVE_MAX_QUEUED_JOBS" in over.text and "4 jobs of yours" in over.text
        assert sorted(r.keys("*")) == before
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 202
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 202
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 429
        # Ended jobs (cancelled here) no longer count.
        cancel = client.delete(f"/v1/batches/{first.json()['batch_id']}", params={"wait": 0})
        assert cancel.status_code == 200
        assert store.unfinished(_tenant_names(store)[0]) == 2
        assert client.post("/v1/batches", json={"tasks": [TASK] * 4}).status_code == 202
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 429
        # A job whose record vanished without an end stops counting once recounted.
        victim = next(iter(store.r.smembers(store._tenant_live(_tenant_names(store)[0]))))
        store.r.delete(store.job_key(victim.decode()))
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 202
    r.close()


def _tenant_names(store: Any) -> list[str]:
    return [
        k.decode().removeprefix(f"{store.p}tenant:").removesuffix(":live")
        for k in store.r.keys(f"{store.p}tenant:*:live")
    ]


def test_tenants_are_counted_apart_and_tokens_never_stored(redis_url: str) -> None:
    other = "tenant-b-token"
    app = make_gateway(
        redis_url, max_queued_jobs=2, api_token=TOKEN, tenant_tokens=f"team-b:{other}"
    )
    store = app.state.services.store
    r = redis.Redis.from_url(redis_url)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        register_backend_with(client, TOKEN)
        mine = {"Authorization": f"Bearer {TOKEN}"}
        theirs = {"Authorization": f"Bearer {other}"}
        wrong = {"Authorization": "Bearer not-a-token"}
        two = {"tasks": [TASK] * 2}
        assert client.post("/v1/batches", json=two, headers=mine).status_code == 202
        assert client.post("/v1/rollouts", json={"task": TASK}, headers=mine).status_code == 429
        # Another tenant's quota is its own; a wrong token is no tenant at all.
        assert client.post("/v1/batches", json=two, headers=theirs).status_code == 202
        assert client.post("/v1/rollouts", json={"task": TASK}, headers=theirs).status_code == 429
        assert client.post("/v1/rollouts", json={"task": TASK}, headers=wrong).status_code == 401
        assert client.post("/v1/rollouts", json={"task": TASK}).status_code == 401
        assert store.unfinished("default") == 2 and store.unfinished("team-b") == 2
        keys = r.keys("*")
        everything = b" ".join(
            keys + [v for k in keys for v in _values(r, k) if isinstance(v, bytes)]
        )
        assert TOKEN.encode() not in everything and other.encode() not in everything
    r.close()


def test_tenant_tokens_are_checked_when_settings_load() -> None:
    for bad in ("no-colon", "bad name:tok", "a:", "a:t,b:t"):
        with pytest.raises(ValueError) as caught:
            Settings(api_token="x", tenant_tokens=bad)
        assert "ROLLSERVE_TENANT_TOKENS" in str(caught.value)
        assert ":t" not in str(caught.value).replace("`name:token", "")
    with pytest.raises(ValueError, match="needs ROLLSERVE_API_TOKEN"):
        Settings(tenant_tokens="a:t")
    assert Settings(api_token="x", tenant_tokens=" a:t1 , b:t2 ").tokens() == {
        "t1": "a",
        "t2": "b",
        "x": "default",
    }


def register_backend_with(client: httpx.Client, token: str) -> None:
    answer = client.post(
        "/v1/backends?verify=false",
        json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 201, answer.text


def test_dynamic_batch_jobs_count_against_their_tenant(redis_url: str) -> None:
    app = make_gateway(redis_url)
    store = app.state.services.store
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        register_backend(client)
        body = {
            "tasks": [TASK] * 6,
            "group_size": 2,
            "dynamic_sampling": {"target_groups": 2, "max_inflight_groups": 2},
        }
        answer = client.post("/v1/batches", json=body)
        assert answer.status_code == 202, answer.text
        assert store.unfinished("anonymous") == 4
        jobs = answer.json()["jobs"]
        # Each job's task is the pool's one copy.
        assert store.get(jobs[0]).task == {**TASK, "instance_id": None}
        assert store.r.hget(store.job_key(jobs[0]), "task") is None
        cancel = client.delete(f"/v1/batches/{answer.json()['batch_id']}", params={"wait": 0})
        assert cancel.status_code == 200
        assert store.unfinished("anonymous") == 0
