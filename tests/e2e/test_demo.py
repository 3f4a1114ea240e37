"""`rollserve demo` as a user runs it: a subprocess that brings up and tears down a whole stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.examples import expected_rewards
from tests.support.procs import processes_mentioning

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    work = tmp_path_factory.mktemp("demo")
    out = work / "demo.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(ROLLSERVE_DATA_DIR=str(work / "data"), ROLLSERVE_TINY_MODEL_DIR=str(tiny_model_dir))
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mean reward" in done.stdout
    return out


def test_demo_rewards_are_the_hand_checked_ones(demo_output: Path) -> None:
    got: dict[str, list[float]] = {}
    for line in demo_output.read_text().splitlines():
        traj = json.loads(line)
        got.setdefault(traj["instance_id"], [0.0] * 4)[traj["sample_index"]] = traj["reward"]
    assert got == expected_rewards()


def test_demo_trajectories_are_ready_for_the_loss(demo_output: Path) -> None:
    lines = demo_output.read_text().splitlines()
    assert len(lines) == 24
    for line in lines:
        traj = json.loads(line)
        assert traj["status"] == "completed"
        n = len(traj["response_ids"])
        assert n > 0 and len(traj["loss_mask"]) == n and len(traj["logprobs"]) == n
        assert all(
            (lp is None) == (m == 0)
            for m, lp in zip(traj["loss_mask"], traj["logprobs"], strict=True)
        )


def test_demo_leaves_no_process_behind(demo_output: Path) -> None:
    # Every child of the demo (Redis, workers, gateway, dev backend) carries its data dir.
    assert processes_mentioning(str(demo_output.parent / "data")) == []
