"""Tool-using jobs end to end: INIT starts a bubblewrap sandbox with its tool server, RUN runs
the model's tool calls in it, EVAL grades in it, and the job's end always stops it. On a
prefork RUN worker and on a many-jobs one (`RUN_POOLS`), whose tools are called over each
box's socket from the worker's one event loop and whose cancelled job's box is reaped
without its process being killed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FINISH = call("finish")
SCRIPT = [
    {
        "match": "GREET-FILE",
        "samples": [
            [call("bash", command="echo hi > /workspace/hello.txt && cat hello.txt"), FINISH],
            [call("finish", result="did nothing")],
        ],
    },
    {"match": "GARBLED", "samples": [["<tool_call>{not json</tool_call>", call("finish")]]},
    {"match": "NEVER-DONE", "samples": [[call("bash", command="ls")] * 20]},
    {"match": "SLEEPER", "samples": [[call("bash", command="sleep 100000"), call("finish")]]},
    {
        "match": "EDIT-FILE",
        "samples": [
            [
                call(
                    "editor",
                    command="str_replace",
                    path="/workspace/app.py",
                    old_str="x = 1",
                    new_str="x = 2",
                ),
                call("finish"),
            ]
        ],
    },
    {"match": "LINGER", "samples": [[call("bash", command="sleep 3")] * 20]},
]


def shell_task(marker: str, check: str, **extra: object) -> dict[str, object]:
    return {
        "data_source": "shell",
        "instance_id": marker.lower(),
        "instruction": f"{marker}: do the task.",
        "check": check,
        **extra,
    }


GREET = shell_task("GREET-FILE", 'test "$(cat /workspace/hello.txt)" = hi')
GARBLED = shell_task("GARBLED", "true")
NEVER_DONE = shell_task("NEVER-DONE", "false")
SLEEPER = shell_task("SLEEPER", "true")
EDIT = shell_task(
    "EDIT-FILE", "grep -q 'x = 2' /workspace/app.py", files={"/workspace/app.py": "x = 1\n"}
)
LINGER = shell_task("LINGER", "true")


RUN_POOLS = {"prefork": 0, "jobs": 8}
"""Each test runs on a prefork RUN worker and on one holding its jobs on one event loop."""


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT, "tool_timeout": 2.0, "reap_interval": 1.0,
        "sandbox_dir": data / "sandboxes", "sandbox_backend": "bwrap",
    }  # fmt: skip


def run(client: RolloutClient, task: dict[str, object], **agent: int) -> Trajectory:
    traj = client.submit_rollout(
        task, sampling={"seed": 0, "max_tokens": 128}, agent=agent or None, wait=True, timeout=90
    )
    assert isinstance(traj, Trajectory), traj
    return traj


def no_sandbox_left(stack: Stack, job_id: str) -> bool:
    """No process carries the job's label and no sandbox state names it."""
    return processes_mentioning(job_id) == [] and not any(
        job_id in meta.read_text(errors="ignore")
        for meta in stack.settings.sandbox_dir.glob("*/meta.json")
    )


def test_tool_calls_run_in_the_sandbox_and_the_check_grades_it(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, GREET)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0
    assert traj.stop_reason == "finish"
    assert traj.tool_calls == 2
    assert [t.type for t in traj.turns] == ["model", "env", "model"]
    assert traj.turns[1].text.strip() == "hi"
    assert traj.eval["exit_code"] == 0
    assert no_sandbox_left(stack, traj.job_id)


def test_a_sample_that_does_not_do_the_task_gets_no_reward(client: RolloutClient) -> None:
    accepted = client.submit_batch([GREET], group_size=2, sampling={"seed": 0, "max_tokens": 128})
    rewards = {t.sample_index: t.reward for t in client.iter_batch_results(accepted.batch_id)}
    assert rewards == {0: 1.0, 1: 0.0}


def test_files_of_the_task_are_in_the_workspace_for_the_editor(client: RolloutClient) -> None:
    traj = run(client, EDIT)
    assert traj.reward == 1.0, traj.turns


def test_a_malformed_call_is_an_error_observation_and_counted(client: RolloutClient) -> None:
    traj = run(client, GARBLED)
    assert traj.status is JobStatus.completed
    assert traj.malformed_tool_calls == 1
    assert traj.turns[1].text.startswith("Error: the tool call is not valid JSON")
    assert traj.stop_reason == "finish"


def test_an_agent_that_never_finishes_stops_at_max_turns(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, NEVER_DONE, max_turns=4)
    assert traj.status is JobStatus.completed
    assert traj.stop_reason == "max_turns"
    assert traj.tool_calls == 4
    assert traj.reward == 0.0
    assert no_sandbox_left(stack, traj.job_id)


def test_a_command_that_never_ends_is_interrupted_by_the_tool_timeout(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, SLEEPER)
    assert traj.status is JobStatus.completed
    assert "timed out" in traj.turns[1].text
    assert traj.timing.tools < 30
    assert no_sandbox_left(stack, traj.job_id)


def test_a_cancelled_jobs_sandbox_is_reaped(client: RolloutClient, stack: Stack) -> None:
    job_id = client.submit_rollout(LINGER, sampling={"seed": 0, "max_tokens": 128})
    assert isinstance(job_id, str)
    wait_until(lambda: client.get_rollout(job_id).tool_calls >= 1, 60, "a tool call to run")
    assert processes_mentioning(job_id) != []
    client.cancel_rollout(job_id)
    wait_until(lambda: no_sandbox_left(stack, job_id), 30, "the reaper to stop the sandbox")
