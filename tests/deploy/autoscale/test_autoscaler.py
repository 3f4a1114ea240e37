"""The control loop over a launcher that keeps its fleet in memory (the launchers themselves
are tested against real processes, Slurm and a stand-in kubectl)."""

from __future__ import annotations

from collections.abc import Sequence

from deploy.autoscale.autoscaler import Autoscaler
from deploy.autoscale.launcher import Launcher, LauncherError, Worker
from deploy.autoscale.policy import QueueLoad, default_policy


class MemoryLauncher(Launcher):
    def __init__(self) -> None:
        self.fleet: dict[str, list[Worker]] = {}
        self.stopped: list[Worker] = []
        self.broken = False
        self.serial = 0

    def start(self, queue: str, count: int) -> list[Worker]:
        if self.broken:
            raise LauncherError("sbatch: error: Slurm controller not responding")
        new = []
        for _ in range(count):
            self.serial += 1
            new.append(Worker(str(self.serial), queue, float(self.serial)))
        self.fleet.setdefault(queue, []).extend(new)
        return new

    def workers(self, queue: str) -> list[Worker]:
        return list(self.fleet.get(queue, []))

    def stop(self, queue: str, workers: Sequence[Worker]) -> None:
        self.fleet[queue] = [w for w in self.fleet[queue] if w not in workers]
        self.stopped.extend(workers)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_scales_out_then_in_after_the_window_stopping_the_newest_first() -> None:
    launcher, clock = MemoryLauncher(), Clock()
    loads = {"eval": QueueLoad(3, 0)}
    policy = default_policy("eval", scale_out_cooldown=0.0, scale_in_cooldown=10.0)
    scaler = Autoscaler(launcher, {"eval": policy}, lambda: loads, clock=clock)
    (step,) = scaler.tick()
    assert step.decision.desired == 4 and [w.id for w in launcher.workers("eval")] == [
        "1", "2", "3", "4",
    ]  # fmt: skip
    loads["eval"] = QueueLoad(0, 0)
    clock.now = 5.0
    scaler.tick()
    assert len(launcher.workers("eval")) == 4
    clock.now = 11.0
    (step,) = scaler.tick()
    assert step.decision.desired == 0 and launcher.workers("eval") == []
    assert [w.id for w in launcher.stopped] == ["4", "3", "2", "1"]


def test_a_fleet_found_at_start_is_not_scaled_in_before_one_window() -> None:
    launcher, clock = MemoryLauncher(), Clock()
    launcher.start("init", 2)
    policy = default_policy("init", scale_in_cooldown=30.0)
    scaler = Autoscaler(launcher, {"init": policy}, lambda: {}, clock=clock)
    scaler.tick()
    assert len(launcher.workers("init")) == 2
    once = Autoscaler(launcher, {"init": policy}, lambda: {}, clock=clock, settle=False)
    (step,) = once.tick(apply=False)
    assert step.decision.desired == 0 and len(launcher.workers("init")) == 2


def test_a_failed_launch_is_reported_and_retried_without_a_cool_down() -> None:
    launcher, clock = MemoryLauncher(), Clock()
    launcher.broken = True
    policy = default_policy("init", scale_out_cooldown=60.0)
    scaler = Autoscaler(launcher, {"init": policy}, lambda: {"init": QueueLoad(1, 0)}, clock=clock)
    (step,) = scaler.tick()
    assert step.error is not None and "not responding" in step.error
    assert "FAILED" in step.describe()
    launcher.broken = False
    clock.now = 1.0
    (step,) = scaler.tick()
    assert step.error is None and len(launcher.workers("init")) == 2
