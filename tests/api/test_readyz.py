"""`GET /readyz` names what a gateway lacks (workers per queue, a healthy backend), quickly
and without a token; a started stack is ready (tests/test_stack.py)."""

from __future__ import annotations

import os
import sys
import uuid

import httpx

from broker.processes import spawn, stop_group
from tests.support.wait import wait_until

TOKEN = "readyz-token"
GATEWAY_SETTINGS = {"api_token": TOKEN}
ALL_MISSING = [
    "a worker on queue init",
    "a worker on queue run",
    "a worker on queue eval",
    "a healthy backend",
]


def readyz(url: str) -> httpx.Response:
    return httpx.get(f"{url}/readyz", timeout=10)


def test_a_gateway_without_workers_or_backends_is_not_ready_and_says_why(gateway: str) -> None:
    answer = readyz(gateway)  # no token needed, like /healthz
    assert answer.status_code == 503, answer.text
    assert answer.json() == {"ready": False, "missing": ALL_MISSING}


def test_a_registered_backend_and_one_queue_s_worker_are_counted(
    gateway: str, redis_url: str
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    answer = httpx.post(
        f"{gateway}/v1/backends?verify=false",
        json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
        headers=headers,
    )
    assert answer.status_code == 201, answer.text
    wait_until(
        lambda: readyz(gateway).json()["missing"] == ALL_MISSING[:3], 5, "the backend to count"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(ROLLSERVE_REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    worker = spawn(
        [sys.executable, "-m", "celery", "-A", "broker.worker_app", "worker", "-Q", "eval",
         "-P", "solo", "-n", f"eval-{uuid.uuid4().hex[:6]}@readyz", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
        env=env,
    )  # fmt: skip
    try:
        wait_until(
            lambda: readyz(gateway).json()["missing"] == ALL_MISSING[:2],
            60,
            "the eval worker to count",
        )
        answer = readyz(gateway)
        assert answer.status_code == 503
        assert set(answer.json()) == {"ready", "missing"}  # names what is missing, nothing else
    finally:
        stop_group(worker, timeout=10)
