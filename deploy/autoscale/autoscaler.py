"""The control loop: read every queue's load, decide each fleet's size, tell the launcher.

One `tick` is one decision per queue; `run` ticks every `interval` seconds until told to
stop. A launcher that fails (its tool errs, the cluster is away) fails that queue's step
only: the decision is reported with the error and the next tick tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from broker.celery_app import QUEUES
from deploy.autoscale.launcher import Launcher, LauncherError
from deploy.autoscale.policy import Decision, QueueLoad, QueueMemory, QueuePolicy, decide

log = logging.getLogger(__name__)


@dataclass
class Step:
    """What one tick did for one queue."""

    decision: Decision
    error: str | None = None

    def describe(self) -> str:
        line = self.decision.describe()
        return f"{line}  FAILED: {self.error}" if self.error else line


class Autoscaler:
    """Sizes each queue's fleet in `policies` with `launcher`, from the loads `read_loads`
    returns."""

    def __init__(
        self,
        launcher: Launcher,
        policies: Mapping[str, QueuePolicy],
        read_loads: Callable[[], Mapping[str, QueueLoad]],
        clock: Callable[[], float] = time.monotonic,
        settle: bool = True,
    ) -> None:
        self.launcher = launcher
        self.policies = dict(policies)
        self.read_loads = read_loads
        self.clock = clock
        # With `settle`, the fleet found at start counts as a change: nothing is scaled in
        # before one scale-in window has passed (a single decision, `--once`, has no window).
        started = clock() if settle else None
        self.memory = {q: QueueMemory(last_change=started) for q in self.policies}

    def tick(self, apply: bool = True) -> list[Step]:
        """One decision per queue, carried out unless `apply` is false."""
        loads = self.read_loads()
        steps = []
        for queue in (q for q in QUEUES if q in self.policies):
            load = loads.get(queue, QueueLoad(0, 0))
            try:
                current = len(self.launcher.workers(queue))
            except LauncherError as exc:
                decision = Decision(queue, 0, 0, load, 0.0, "cannot list workers")
                steps.append(Step(decision, str(exc)))
                continue
            memory = self.memory[queue]
            saved = replace(memory, recent=memory.recent.copy())
            decision = decide(queue, self.policies[queue], load, current, memory, self.clock())
            step = Step(decision)
            if decision.delta and apply:
                try:
                    self.launcher.scale(queue, decision.desired)
                except LauncherError as exc:
                    self.memory[queue] = saved  # not made: the cool-downs did not start
                    step.error = str(exc)
            steps.append(step)
        return steps

    def run(
        self,
        stop: threading.Event,
        interval: float,
        report: Callable[[Step], None] = lambda step: None,
    ) -> None:
        """Tick every `interval` seconds until `stop` is set; each step goes to `report`."""
        while not stop.is_set():
            try:
                for step in self.tick():
                    report(step)
            except Exception:  # Redis away: try again next tick
                log.exception("autoscaler: reading the queues failed")
            stop.wait(interval)
