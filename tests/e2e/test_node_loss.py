"""A node lost mid-job, end to end with two worker hosts sharing one Redis: a sandboxed job
whose RUN is pinned to the node holding its box starts again from INIT on the other node
when every worker of its node is SIGKILLed, and completes once; the box it left on the lost
node is reaped when a worker of that node comes back."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api.client import RolloutClient
from core.schemas import JobStatus
from deploy.stack import Stack
from tests.support.stack import start_stack
from tests.support.wait import wait_until

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
SCRIPT = [{"match": "FAR-WORK", "samples": [[WRITE, FINISH]], "delay": 3.0}]
TASK = {
    "data_source": "shell",
    "instruction": "FAR-WORK: write ok to out.txt.",
    "check": 'test "$(cat /workspace/out.txt)" = ok',
}
NODE_B = ("worker-init-b", "worker-run-b", "worker-eval-b")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("node-loss")
    stack = start_stack(
        data, tiny_model_dir, script=SCRIPT, node_name="node-a",
        sandbox_dir=data / "sandboxes-a", sandbox_backend="bwrap", reap_interval=1.0,
        run_soft_time_limit=30.0, run_time_limit=40.0, eval_soft_time_limit=30.0,
        eval_time_limit=40.0, visibility_timeout=900.0,
        workers={"init": 0, "run": 1, "eval": 1},
    )  # fmt: skip
    for name in NODE_B:
        stack.wait_worker(stack.start_worker(name.split("-")[1], 1, name=name, env=node_b(stack)))
    yield stack
    stack.stop()


def node_b(stack: Stack) -> dict[str, str]:
    data = stack.settings.data_dir
    return {"ROLLSERVE_NODE_NAME": "node-b", "ROLLSERVE_SANDBOX_DIR": str(data / "sandboxes-b")}


def test_a_job_pinned_to_a_lost_node_starts_again_elsewhere(two_hosts: Stack) -> None:
    r = redis.Redis.from_url(two_hosts.redis_url, decode_responses=True)
    boxes_b = two_hosts.settings.data_dir / "sandboxes-b"
    with RolloutClient(two_hosts.gateway_url, timeout=60) as client:
        job_id = client.submit_rollout(TASK, sampling={"seed": 0, "max_tokens": 64})
        assert isinstance(job_id, str)
        # the only INIT worker is node-b's: the box, and so the RUN, are there
        wait_until(lambda: r.hget(f"rs:job:{job_id}", "host_run") == "node-b", 60, "RUN on node-b")
        two_hosts.wait_worker(two_hosts.start_worker("init", 1, name="worker-init-a"))
        for name in NODE_B:
            two_hosts.kill_worker(name, signal.SIGKILL)
        wait_until(lambda: client.get_rollout(job_id).status.terminal, 180, "the job to end")
        traj = client.get_rollout(job_id)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0
    assert (traj.hosts["init"], traj.hosts["run"], traj.hosts["eval"]) == ("node-a",) * 3
    assert r.hget(f"rs:job:{job_id}", "attempt") == "1"
    assert r.hget("rs:counts", "completed") == "1"
    # the lost attempt's box stays on node-b until a worker of node-b reaps it
    assert [p for p in boxes_b.iterdir() if not p.name.startswith(".")]
    two_hosts.wait_worker(
        two_hosts.start_worker("eval", 1, name="worker-eval-b2", env=node_b(two_hosts))
    )
    wait_until(
        lambda: not [p for p in boxes_b.iterdir() if not p.name.startswith(".")],
        60,
        "node-b's reaper to remove the lost attempt's box",
    )
