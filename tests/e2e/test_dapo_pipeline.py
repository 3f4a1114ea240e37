"""Dynamic sampling end to end on a real stack: REST → Redis → init/run/eval workers →
the development server playing scripted rewards, with bubblewrap sandboxes.

The pools mix tasks whose samples are all right, all wrong, mixed (informative), and slow
mixed ones that are still running when the target is met. When the results stream ends (the
call returns), exactly the target's informative groups came back and nothing of the batch
runs or holds a sandbox or a backend slot — checked at once, with the sandbox reaper turned
far down so that only the cancellation path can have freed them, and with no grace before
running stages are terminated, so the kill path and its confirmation are what is tested
(the run stage's own stop within a turn is the routing tests' subject). Each test runs on a
prefork RUN worker and on a many-jobs one (`RUN_POOLS`), where stopping a running job
cancels its task on the worker's event loop instead of killing a process.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from api.client import RolloutClient
from broker.celery_app import create_celery
from core.schemas import BatchProgress, JobStatus, Trajectory
from deploy.stack import Stack
from routing.pool import BackendPool
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


RIGHT, WRONG = "So it is \\boxed{4}.", "I think \\boxed{5}."
TOUCH, FINISH = call("bash", command="touch /workspace/ok"), call("finish")
SLOW_DELAY = 90.0  # far beyond the target: these are always cut off

SCRIPT: list[dict[str, Any]] = [
    # seed i answers samples[i % len]: with seeds 0, 1 a mixed group has one of each
    *({"match": f"RIGHT-{k}:", "samples": [[RIGHT]]} for k in range(3)),
    *({"match": f"WRONG-{k}:", "samples": [[WRONG]]} for k in range(3)),
    *({"match": f"MIXED-{k}:", "samples": [[RIGHT], [WRONG]]} for k in range(4)),
    *(
        {"match": f"SLOW-{k}:", "samples": [[RIGHT], [WRONG]], "delay": SLOW_DELAY}
        for k in range(2)
    ),
    *({"match": f"S-RIGHT-{k}:", "samples": [[TOUCH, FINISH]]} for k in range(2)),
    *({"match": f"S-MIXED-{k}:", "samples": [[TOUCH, FINISH], [FINISH]]} for k in range(3)),
    *(
        {"match": f"S-SLOW-{k}:", "samples": [[call("bash", command="sleep 20")] * 20]}
        for k in range(2)
    ),
]


def math_task(marker: str) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": marker.lower(),
        "problem": f"{marker}: What is 2+2?",
        "answer": "4",
    }


def shell_task(marker: str) -> dict[str, str]:
    return {
        "data_source": "shell",
        "instance_id": marker.lower(),
        "instruction": f"{marker}: create /workspace/ok.",
        "check": "test -f /workspace/ok",
    }


RUN_POOLS = {"prefork": 0, "jobs": 6}
"""Each test runs on a prefork RUN worker and on one holding its jobs on one event loop."""


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT,
        "workers": {"init": 2, "run": 6, "eval": 2},
        "run_soft_time_limit": 120.0,
        "run_time_limit": 130.0,
        "visibility_timeout": 150.0,
        "reap_interval": 3600.0,  # only the cancellation may free sandboxes here
        "cancel_grace": 0.0,  # every running stage is killed at once (revoke terminate)
        "tool_timeout": 30.0,
        "sandbox_dir": data / "sandboxes",
        "sandbox_backend": "bwrap" if shutil.which("bwrap") else "local",
    }


def groups_of(trajectories: list[Trajectory]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajectories:
        groups[traj.group_id].append(traj)
    return dict(groups)


def assert_nothing_left(stack: Stack, client: RolloutClient, batch_id: str) -> None:
    """No job of the batch runs, holds a backend slot or a sandbox — right now."""
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    job_ids = r.lrange(f"rs:batch:{batch_id}:jobs", 0, -1)
    assert job_ids
    for job_id in job_ids:
        record = r.hgetall(f"rs:job:{job_id}")
        assert record["status"] in {s.value for s in JobStatus if s.terminal}, record
        if record["status"] == JobStatus.cancelled.value:
            # A cancelled job counts as ended only once its stage has stopped (finish.lua).
            assert not record.get("active"), f"a stage of {job_id} is still marked running"
    # A job that ended by itself was recorded by its last stage, which ends moments later.
    wait_until(
        lambda: not any(r.hget(f"rs:job:{job_id}", "active") for job_id in job_ids),
        15,
        "the last stage of every job to end",
    )
    # the workers themselves: no stage task of the batch is executing anywhere (a stage's
    # task returns just after its stage ended)
    app = create_celery(stack.settings, stack.redis_url)

    def running() -> set[str]:
        active = app.control.inspect(timeout=2.0).active() or {}
        ids = {t["id"] for tasks in active.values() for t in tasks}
        return {t for t in ids if t.rsplit("-", 1)[0] in job_ids}

    wait_until(lambda: not running(), 15, "no stage task of the batch to be executing")
    pool = BackendPool(r, "rs:")
    assert all(n == 0 for n in pool.in_flight().values()), pool.in_flight()
    assert not set(pool.holders()) & set(job_ids)
    metas = list(stack.settings.sandbox_dir.glob("*/meta.json"))
    assert not [m for m in metas if any(j in m.read_text(errors="ignore") for j in job_ids)]
    assert processes_mentioning(batch_id) == []
    progress = client.batch_progress(batch_id)
    assert progress.done
    assert progress.dynamic is None or progress.dynamic.unconfirmed_stops == 0


def run_dynamic(
    client: RolloutClient, tasks: list[dict[str, str]], **dynamic: Any
) -> tuple[str, list[Trajectory], BatchProgress]:
    accepted = client.submit_batch(
        tasks,
        group_size=2,
        sampling={"seed": 0, "max_tokens": 128},
        dynamic_sampling=dynamic,
    )
    returned = list(client.iter_batch_results(accepted.batch_id))  # the call returns here
    return accepted.batch_id, returned, client.batch_progress(accepted.batch_id)


def test_a_dynamic_batch_returns_exactly_the_target_and_stops_the_rest(
    client: RolloutClient, stack: Stack
) -> None:
    markers = ["SLOW-0", "SLOW-1", "RIGHT-0", "WRONG-0", "MIXED-0", "RIGHT-1", "WRONG-1"]
    markers += ["MIXED-1", "RIGHT-2", "MIXED-2", "WRONG-2", "MIXED-3"]
    tasks = [math_task(m) for m in markers]
    batch_id, returned, progress = run_dynamic(
        client, tasks, target_groups=3, max_inflight_groups=4, max_attempts_per_task=2
    )
    assert_nothing_left(stack, client, batch_id)

    groups = groups_of(returned)
    assert len(groups) == 3 and len(returned) == 6
    for group in groups.values():
        assert len(group) == 2 and len({t.instance_id for t in group}) == 1
        assert sorted(t.reward for t in group if t.reward is not None) == [0.0, 1.0]  # informative
        assert all(t.status is JobStatus.completed for t in group)
        assert group[0].instance_id.startswith("mixed-")

    dyn = progress.dynamic
    assert dyn is not None and progress.done
    assert (dyn.state, dyn.groups_accepted, dyn.target_reached) == ("done", 3, True)
    assert dyn.accepted_groups == list(groups)
    assert dyn.groups_cancelled >= 2  # the slow groups were cut short
    assert dyn.groups_filtered >= 2 and dyn.groups_failed == 0
    counted = dyn.groups_accepted + dyn.groups_filtered + dyn.groups_cancelled
    assert dyn.groups_drawn == counted + dyn.groups_surplus
    assert dyn.rollouts_wasted >= 4 and dyn.rollout_seconds_wasted > 0
    assert dyn.time_to_target is not None and dyn.time_to_done is not None
    drawn = {t for t in range(len(tasks)) if t not in dyn.tasks_never_drawn}
    assert {markers.index(t.instance_id.upper()) for t in returned} <= drawn
    assert "mixed-3" not in {t.instance_id for t in returned}  # the target came first
    # the slow jobs were stopped mid-run, keeping their partial trajectory and the reason
    slow = [client.get_rollout(f"{batch_id}-{g}-{i}") for g in (1, 2) for i in (0, 1)]
    for traj in slow:
        assert traj.status is JobStatus.cancelled, traj.status
        assert traj.error is not None and "target of 3" in traj.error.message
        assert traj.reward is None


@needs_bwrap
def test_sandboxed_groups_cancelled_at_the_target_leave_no_box(
    client: RolloutClient, stack: Stack
) -> None:
    markers = ["S-SLOW-0", "S-SLOW-1", "S-RIGHT-0", "S-MIXED-0", "S-RIGHT-1", "S-MIXED-1"]
    markers += ["S-MIXED-2"]
    tasks = [shell_task(m) for m in markers]
    batch_id, returned, progress = run_dynamic(
        client, tasks, target_groups=2, max_inflight_groups=3
    )
    assert_nothing_left(stack, client, batch_id)
    groups = groups_of(returned)
    assert len(groups) == 2
    for group in groups.values():
        assert group[0].instance_id.startswith("s-mixed-")
        assert sorted(t.reward for t in group if t.reward is not None) == [0.0, 1.0]
    dyn = progress.dynamic
    assert dyn is not None and dyn.groups_cancelled >= 2 and dyn.groups_accepted == 2
    slow = [client.get_rollout(f"{batch_id}-{g}-{i}") for g in (1, 2) for i in (0, 1)]
    assert all(t.status is JobStatus.cancelled for t in slow)
    assert any(t.tool_calls >= 1 for t in slow)  # their boxes were in use when cut off


@needs_bwrap
def test_cancelling_a_plain_batch_stops_its_running_jobs_and_frees_their_boxes(
    client: RolloutClient, stack: Stack
) -> None:
    tasks = [shell_task("S-SLOW-0"), shell_task("S-SLOW-1"), math_task("SLOW-0")]
    accepted = client.submit_batch(tasks, group_size=2, sampling={"seed": 0, "max_tokens": 128})
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)

    def all_running() -> bool:
        return all(r.hget(f"rs:job:{j}", "status") == "run" for j in accepted.jobs)

    wait_until(all_running, 60, "every job of the batch to run")
    assert processes_mentioning(accepted.jobs[0]) != []  # its sandbox is up
    progress = client.cancel_batch(accepted.batch_id)
    assert progress.done and progress.counts == {"cancelled": 6, "pending": 0}
    assert_nothing_left(stack, client, accepted.batch_id)
    # the stream of a cancelled plain batch still ends, with every job as it stood
    assert len(list(client.iter_batch_results(accepted.batch_id))) == 6
