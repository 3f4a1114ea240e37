"""An inference server that restarts after a weight update never serves under a version it
does not hold, end to end: the stack's supervisor restarts the SIGKILLed development server
(with the weights it was started with); the workers' health sweep sees its new start time,
holds it out, loads the update's checkpoint again, and only then lets it work. The next job
carries the update's policy version and exactly the logprobs of the updated weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from tests.support.wait import wait_until
from tests.support.weights import WeightDirs

pytestmark = pytest.mark.full

SCRIPT = [{"match": "RESTART", "samples": [["It is \\boxed{4}."]]}]
TASK = {"data_source": "math", "instance_id": "r", "problem": "RESTART: 2+2?", "answer": "4"}


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {"script": SCRIPT, "workers": {"init": 1, "run": 1, "eval": 1}, "health_interval": 1.0}


def logprobs_of(client: RolloutClient) -> tuple[int | None, list[float]]:
    traj = client.submit_rollout(TASK, sampling={"seed": 0}, wait=True, timeout=120)
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
