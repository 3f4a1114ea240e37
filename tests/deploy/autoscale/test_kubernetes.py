"""The Kubernetes launcher against a stand-in `kubectl` on PATH that records its arguments
(`fake_kubectl.py`); no real cluster runs in the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deploy.autoscale.autoscaler import Autoscaler
from deploy.autoscale.kubernetes import KubernetesLauncher
from deploy.autoscale.launcher import LauncherError
from deploy.autoscale.policy import QueueLoad, default_policy

FAKE = Path(__file__).with_name("fake_kubectl.py")


@pytest.fixture
def kubectl(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH finds the stand-in first, and its state directory (with
    Deployments for init at 0 and run at 1 replicas)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(FAKE)
    state = tmp_path / "state"
    state.mkdir()
    replicas = {"rollserve-worker-init": 0, "rollserve-worker-run": 1}
    (state / "replicas.json").write_text(json.dumps(replicas))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["FAKE_KUBECTL_DIR"] = str(state)
    return env, state


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def replicas(state: Path) -> dict[str, int]:
    return dict(json.loads((state / "replicas.json").read_text()))


def test_scaling_sets_the_replicas_of_the_queues_deployment(
    kubectl: tuple[dict[str, str], Path],
) -> None:
    env, state = kubectl
    launcher = KubernetesLauncher(namespace="rl", env=env)
    assert len(launcher.workers("run")) == 1
    assert launcher.scale("run", 3) == 1
    assert replicas(state)["rollserve-worker-run"] == 3
    launcher.stop("run", launcher.workers("run")[2:])
    assert replicas(state)["rollserve-worker-run"] == 2
    assert [
        "scale", "deployment/rollserve-worker-run", "--replicas=3", "--namespace", "rl",
    ] in calls(state)  # fmt: skip
    assert [
        "get", "deployment/rollserve-worker-run", "--output=json", "--namespace", "rl",
    ] in calls(state)  # fmt: skip


def test_the_autoscaler_drives_deployments_from_the_queues(
    kubectl: tuple[dict[str, str], Path],
) -> None:
    env, state = kubectl
    launcher = KubernetesLauncher(env=env)
    loads = {"init": QueueLoad(3, 0), "run": QueueLoad(0, 0)}
    policies = {
        "init": default_policy("init", scale_out_cooldown=0.0),
        "run": default_policy("run", scale_in_cooldown=0.0),
    }
    scaler = Autoscaler(launcher, policies, lambda: loads, settle=False)
    steps = {step.decision.queue: step for step in scaler.tick()}
    assert steps["init"].decision.desired == 4 and steps["init"].error is None
    assert steps["run"].decision.desired == 1
    assert replicas(state) == {"rollserve-worker-init": 4, "rollserve-worker-run": 1}
    assert not [c for c in calls(state) if c[:2] == ["scale", "deployment/rollserve-worker-run"]]


def test_a_missing_deployment_is_a_launcher_error_that_names_it(
    kubectl: tuple[dict[str, str], Path],
) -> None:
    env, _ = kubectl
    with pytest.raises(LauncherError, match="rollserve-worker-eval"):
        KubernetesLauncher(env=env).workers("eval")
    scaler = Autoscaler(
        KubernetesLauncher(env=env), {"eval": default_policy("eval")}, lambda: {}, settle=False
    )
    (step,) = scaler.tick()
    assert step.error is not None and "NotFound" in step.error
