"""What a long run survives, end to end on one stack:

- its RUN worker SIGKILLed while the engine answers a model call in the middle of a multi-turn
  episode in a bubblewrap box: the sweeper hands RUN to a fresh worker on the same node, which
  goes on from the last saved turn in the same box. No saved call is made again and no tool
  call runs twice (every line the episode's bash calls append to a file is there once), and
  the trajectory says where it was resumed;
- its inference server restarting after a weight update: the stack's supervisor restarts the
  SIGKILLed development server (with the weights it was started with); the workers' health
  sweep sees its new start time, holds it out, loads the update's checkpoint again, and only
  then lets it work. The next job carries the update's policy version and exactly the
  logprobs of the updated weights.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from api.client import RolloutClient
from core.schemas import EnvTurn, JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from tests.e2e.test_recovery import holder_pid, job_fields
from tests.support.swe import bwrap_problem
from tests.support.wait import wait_until
from tests.support.weights import WeightDirs

pytestmark = pytest.mark.full

needs_bwrap = pytest.mark.skipif(
    bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
)

CALLS = 8
"""Bash calls of the episode, each appending its number to /workspace/log.txt; then finish."""
DELAY = 2.5
"""Seconds each model call takes on the development server: the window the kill lands in."""


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = [
    {"match": "RESTART", "samples": [["It is \\boxed{4}."]]},
    {
        "match": "RESUME-LOG",
        "samples": [
            [call("bash", command=f"echo {k} >> /workspace/log.txt") for k in range(CALLS)]
            + [call("finish", result="logged")]
        ],
        "delay": DELAY,
    },
]
TASK = {
    "data_source": "shell",
    "instance_id": "resume-log",
    "instruction": "RESUME-LOG: append 0 to 7 to /workspace/log.txt, one per line.",
    # Every line once, in order: a tool call run twice would show.
    "check": f'test "$(cat /workspace/log.txt)" = "$(seq 0 {CALLS - 1})"',
}


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT,
        "workers": {"init": 1, "run": 1, "eval": 1},
        "sandbox_dir": data / "sandboxes",
        "sandbox_backend": "bwrap" if bwrap_problem() is None else "local",
        "run_soft_time_limit": 120.0,
        "run_time_limit": 130.0,
        "visibility_timeout": 900.0,  # only the sweeper's takeover brings RUN back in time
        "health_interval": 1.0,  # a restarted engine is seen within a second
    }


def requests_in_flight(stack: Stack) -> float:
    """Requests the engine holds: waiting (the script's delay) or running."""
    answer = httpx.get(
        f"{stack.dev_backend_url}/metrics",
        headers={"Authorization": f"Bearer {stack.backend_api_key}"},
        timeout=10,
    )
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in answer.text.splitlines()
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
    )


@needs_bwrap
def test_a_run_worker_killed_mid_episode_is_resumed_from_its_last_saved_turn(
    client: RolloutClient, stack: Stack
) -> None:
    job_id = client.submit_rollout(
        TASK, sampling={"seed": 0, "max_tokens": 128}, agent={"max_turns": CALLS + 2}
    )
    assert isinstance(job_id, str)
    r = redis.Redis.from_url(stack.redis_url)

    def between_turns() -> bool:
        """Half the calls' replies saved, and the next call on the engine."""
        turns = client.get_rollout(job_id).turns
        replies = sum(isinstance(t, EnvTurn) for t in turns)
        return (
            replies >= CALLS // 2
            and isinstance(turns[-1], EnvTurn)
            and requests_in_flight(stack) >= 1
        )

    def frozen_between_turns() -> str | None:
        """The RUN worker holding the job, stopped (SIGSTOP, its whole group) while the
        engine holds its model call and every earlier turn is saved; None (and running
        again) when the stop came a moment too late."""
        wait_until(between_turns, 120, "the episode half done, a model call in flight")
        holder = holder_pid(job_fields(r, job_id))
        [victim] = [n for n in stack.worker_names if stack.children[n].pid == holder]
        os.killpg(stack.children[victim].pid, signal.SIGSTOP)
        # Read after the stop: a call still on the engine means the worker waits for its
        # answer, so no tool of this turn has run (it cannot start one while stopped).
        if between_turns():
            return victim
        os.killpg(stack.children[victim].pid, signal.SIGCONT)
        return None

    victim = None
    while victim is None:
        victim = frozen_between_turns()
    saved = client.get_rollout(job_id)
    stack.kill_worker(victim, signal.SIGKILL)
    stack.wait_worker(stack.start_worker("run", 1))

    wait_until(lambda: client.get_rollout(job_id).status.terminal, 180, "the job to end")
    traj = client.get_rollout(job_id)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0  # each line once: no tool call ran twice
    assert traj.stop_reason == "finish"
    [resume] = traj.resumes
    assert resume.attempt == 1 and resume.dropped_turns == 0
    assert resume.turn == len(saved.turns)
    assert resume.reprefill_ids == len(saved.prompt_ids) + len(saved.response_ids)
    # The saved turns are kept as they were, and the episode has every call once.
    assert [t.model_dump() for t in traj.turns[: len(saved.turns)]] == [
        t.model_dump() for t in saved.turns
    ]
    assert sum(isinstance(t, ModelTurn) for t in traj.turns) == CALLS + 1
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert all(b.in_flight == 0 for b in client.list_backends())


RESTART_TASK = {
    "data_source": "math",
    "instance_id": "r",
    "problem": "RESTART: 2+2?",
    "answer": "4",
}


def logprobs_of(client: RolloutClient) -> tuple[int | None, list[float]]:
    traj = client.submit_rollout(RESTART_TASK, sampling={"seed": 0}, wait=True, timeout=120)
    assert isinstance(traj, Trajectory) and traj.status is JobStatus.completed, traj
    turn = traj.turns[0]
    assert isinstance(turn, ModelTurn)
    return turn.policy_version, turn.logprobs


def test_a_restarted_engine_is_loaded_with_its_last_weights_before_it_serves(
    client: RolloutClient, stack: Stack, weight_dirs: WeightDirs
) -> None:
    _, original = logprobs_of(client)
    report = client.update_weights(str(weight_dirs.perturbed), policy_version=2)
    assert report.ok, report.error
    version, updated = logprobs_of(client)
    assert version == 2 and updated != original  # the weights decide the logprobs
    [backend] = client.list_backends()
    assert backend.weights_path == str(weight_dirs.perturbed)
    wait_until(
        lambda: client.list_backends()[0].started_at is not None, 30, "a sweep to see its start"
    )
    first_start = client.list_backends()[0].started_at

    # The supervisor restarts the server on the same port, with its first weights.
    os.killpg(stack.children["dev-backend"].pid, signal.SIGKILL)

    def reloaded() -> bool:
        now = client.list_backends()[0]
        return now.started_at != first_start and now.state == "healthy" and now.note is None

    wait_until(reloaded, 120, "the restarted server to be loaded again and re-admitted")
    version, again = logprobs_of(client)
    assert version == 2
    assert again == updated
