"""Reading each queue's load from Redis, and `rollserve autoscale --once` on it (with the
stand-in kubectl of `fake_kubectl.py`; no cluster runs in the tests)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from broker.celery_app import PRIORITY_SEP, UNACKED, UNACKED_INDEX
from broker.jobstore import JobStore
from deploy.autoscale.policy import QueueLoad
from deploy.autoscale.state import read_loads

FAKE = Path(__file__).with_name("fake_kubectl.py")
REPO = Path(__file__).resolve().parents[3]


def fetched(client: redis.Redis, tag: str, task: str, job_id: str) -> None:
    """A stage message a worker fetched and has not acknowledged, as kombu keeps it."""
    body = base64.b64encode(json.dumps([[job_id, 0], {}, {}]).encode()).decode()
    message = {"headers": {"task": task, "id": f"t-{job_id}"}, "body": body}
    client.hset(UNACKED, tag, json.dumps([message, "", task.rpartition(".")[2]]))
    client.zadd(UNACKED_INDEX, {tag: time.time()})


def fill(client: redis.Redis) -> None:
    """init: 3 waiting; run: 1 waiting on a node's queue, 2 in flight; eval: 1 waiting at a
    priority; plus a message that is no stage of ours."""
    store = JobStore(client)
    store.beat("w1", "node-a", ["run"], ttl=60)
    client.rpush("init", "m1", "m2", "m3")
    client.rpush("run.node-a", "m4")
    client.rpush(f"eval{PRIORITY_SEP}9", "m5")
    fetched(client, "tag-1", "rollserve.run", "job-1")
    fetched(client, "tag-2", "rollserve.run", "job-2")
    fetched(client, "tag-3", "other.task", "job-3")


def test_loads_count_priority_and_node_lists_and_unacknowledged_stages(
    redis_client: redis.Redis,
) -> None:
    fill(redis_client)
    assert read_loads(JobStore(redis_client)) == {
        "init": QueueLoad(waiting=3, in_flight=0),
        "run": QueueLoad(waiting=1, in_flight=2),
        "eval": QueueLoad(waiting=1, in_flight=0),
    }


def test_autoscale_once_prints_each_decision_and_scales_the_deployments(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    fill(redis_client)
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "kubectl").symlink_to(FAKE)
    replicas = {f"rollserve-worker-{q}": 1 for q in ("init", "run", "eval")}
    (state / "replicas.json").write_text(json.dumps(replicas))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_KUBECTL_DIR": str(state),
        "ROLLSERVE_REDIS_URL": redis_url,
        "ROLLSERVE_DATA_DIR": str(tmp_path / "data"),
    }
    argv = [sys.executable, "-m", "deploy.cli", "autoscale", "--launcher", "k8s", "--once"]
    done = subprocess.run(
        [*argv, "--init-max", "3"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert "waiting=3" in lines["init"] and "workers 1 -> 3" in lines["init"]
    assert "in_flight=2" in lines["run"] and "workers 1 -> 4" in lines["run"]
    assert "workers 1 -> 2" in lines["eval"]
    assert json.loads((state / "replicas.json").read_text()) == {
        "rollserve-worker-init": 3,
        "rollserve-worker-run": 4,
        "rollserve-worker-eval": 2,
    }


def test_autoscale_without_redis_says_which_setting_is_missing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLSERVE_REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "autoscale", "--once"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "ROLLSERVE_REDIS_URL" in done.stderr
