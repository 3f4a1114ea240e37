"""Sandbox locality with two worker hosts sharing one Redis: a sandboxed job's RUN runs on the
node whose INIT started its sandbox; jobs without a sandbox run anywhere."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api.client import RolloutClient
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.stack import start_stack

pytestmark = [
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bubblewrap is not installed (apt-get install bubblewrap)",
    ),
    pytest.mark.full,
]

FINISH = '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>'
WRITE = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "echo ok > /workspace/out.txt"}}\n'
    "</tool_call>"
)
SCRIPT = [{"match": "LOCAL-WORK", "samples": [[WRITE, FINISH]]}]
TASK = {
    "data_source": "shell",
    "instruction": "LOCAL-WORK: write ok to out.txt.",
    "check": 'test "$(cat /workspace/out.txt)" = ok',
}


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("two-hosts")
    stack = start_stack(
        data, tiny_model_dir, script=SCRIPT, node_name="node-a",
        sandbox_dir=data / "sandboxes-a", sandbox_backend="bwrap", reap_interval=1.0,
        workers={"init": 1, "run": 1, "eval": 1},
    )  # fmt: skip
    node_b = {"ROLLSERVE_NODE_NAME": "node-b", "ROLLSERVE_SANDBOX_DIR": str(data / "sandboxes-b")}
    stack.wait_worker(stack.start_worker("run", 2, name="worker-run-b", env=node_b))
    stack.wait_worker(stack.start_worker("eval", 1, name="worker-eval-b", env=node_b))
    yield stack
    stack.stop()


def run_batch(stack: Stack, tasks: list[dict[str, object]]) -> list[Trajectory]:
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        accepted = client.submit_batch(tasks, group_size=2, sampling={"seed": 0, "max_tokens": 64})
        results = list(client.iter_batch_results(accepted.batch_id))
    assert all(t.status is JobStatus.completed for t in results), [t.error for t in results]
    return results


def test_run_follows_init_to_the_node_that_holds_the_sandbox(two_hosts: Stack) -> None:
    # Only node-a has an INIT worker: every sandbox is there, and so is every RUN, although
    # node-b's two idle RUN processes listen on the shared run queue too.
    results = run_batch(two_hosts, [TASK] * 3)
    assert {(t.hosts["init"], t.hosts["run"]) for t in results} == {("node-a", "node-a")}
    assert all(t.reward == 1.0 for t in results)


def test_when_init_moves_to_another_node_run_moves_with_it(two_hosts: Stack) -> None:
    [init_a] = [n for n in two_hosts.worker_names if n.startswith("worker-init")]
    data = two_hosts.settings.data_dir
    node_b = {"ROLLSERVE_NODE_NAME": "node-b", "ROLLSERVE_SANDBOX_DIR": str(data / "sandboxes-b")}
    two_hosts.wait_worker(two_hosts.start_worker("init", 1, name="worker-init-b", env=node_b))
    two_hosts.kill_worker(init_a, signal.SIGTERM)
    results = run_batch(two_hosts, [TASK] * 3)
    assert {(t.hosts["init"], t.hosts["run"]) for t in results} == {("node-b", "node-b")}
    assert all(t.reward == 1.0 for t in results)
    # The shell handler grades in its sandbox, so EVAL is pinned there too.
    assert {t.hosts["eval"] for t in results} == {"node-b"}
    r = redis.Redis.from_url(two_hosts.redis_url, decode_responses=True)
    boxes = [json.loads(r.hget(f"rs:job:{t.job_id}", "sandbox") or "{}") for t in results]
    assert all(Path(box["state_dir"]).is_relative_to(data / "sandboxes-b") for box in boxes)
