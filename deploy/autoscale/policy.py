"""How many workers each queue should have: a pure function of what the queue holds.

Per queue, demand is the jobs waiting in it plus the jobs its workers hold (in flight). A
worker runs `concurrency` jobs at once; the fleet is sized so that demand fills a
`target_busy_share` of its slots. Scaling out follows demand at once, at most once per
`scale_out_cooldown`. Scaling in is slower and damped twice (hysteresis): it sizes for a
lower busy share (`target_busy_share - hysteresis`), and takes the largest size asked over
the last `scale_in_cooldown` seconds, so a fleet shrinks only after demand stayed low for the
whole window, never between two bursts that come faster than that.

INIT and EVAL may go to zero workers when nothing is waiting; RUN keeps at least one unless
its policy says `scale_to_zero` (a RUN job pinned to a node needs a worker there to finish).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueuePolicy:
    """The bounds and targets of one queue's fleet."""

    min_workers: int = 0
    """Fewest workers, whatever the demand (see `scale_to_zero`)."""
    max_workers: int = 4
    """Most workers, whatever the demand."""
    concurrency: int = 1
    """Jobs one worker runs at once (its prefork processes)."""
    target_busy_share: float = 0.8
    """Share of the fleet's slots demand should fill when scaling out (0 < share <= 1)."""
    hysteresis: float = 0.2
    """How much lower the busy share is that scaling in sizes for."""
    scale_out_cooldown: float = 10.0
    """Seconds after a scale-out before the next one."""
    scale_in_cooldown: float = 60.0
    """Seconds after any change before scaling in, and the window whose largest demand a
    scale-in must cover."""
    scale_to_zero: bool = True
    """Whether an idle queue may have no worker at all."""

    def __post_init__(self) -> None:
        if self.min_workers < 0 or self.max_workers < self.min_workers:
            raise ValueError(
                f"workers: need 0 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {self.concurrency}")
        if not 0 < self.target_busy_share <= 1:
            raise ValueError(f"target_busy_share must be in (0, 1], not {self.target_busy_share}")
        if not 0 <= self.hysteresis < self.target_busy_share:
            raise ValueError(f"hysteresis must be in [0, target_busy_share), not {self.hysteresis}")
        if self.scale_out_cooldown < 0 or self.scale_in_cooldown < 0:
            raise ValueError("cool-downs cannot be negative")

    @property
    def floor(self) -> int:
        """Fewest workers this queue ever has: at least one unless it may scale to zero."""
        return self.min_workers if self.scale_to_zero else max(self.min_workers, 1)


def default_policy(queue: str, **overrides: object) -> QueuePolicy:
    """The policy of `queue` with `overrides`: RUN keeps one worker by default."""
    base: dict[str, object] = {"scale_to_zero": queue != "run"}
    if queue == "run":
        base["min_workers"] = 1
    base.update(overrides)
    return QueuePolicy(**base)  # type: ignore[arg-type]


@dataclass(frozen=True)
class QueueLoad:
    """What one queue holds right now."""

    waiting: int
    """Messages waiting in the queue (and its per-node and priority lists)."""
    in_flight: int
    """Jobs its workers have taken and not finished."""

    @property
    def demand(self) -> int:
        return self.waiting + self.in_flight


@dataclass
class QueueMemory:
    """What the policy remembers of one queue between decisions."""

    last_scale_out: float | None = None
    last_change: float | None = None
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, fleet size scaling in would allow) over the last `scale_in_cooldown` seconds."""


@dataclass(frozen=True)
class Decision:
    """One decision for one queue: from `current` workers to `desired`, and why."""

    queue: str
    current: int
    desired: int
    load: QueueLoad
    busy_share: float
    """Share of the current fleet's slots in use (1.0 for demand on no workers)."""
    reason: str

    @property
    def delta(self) -> int:
        return self.desired - self.current

    def describe(self) -> str:
        """One line for the log: queue, load, the change and why."""
        change = f"{self.current} -> {self.desired}" if self.delta else f"{self.current}"
        return (
            f"{self.queue:<5} waiting={self.load.waiting} in_flight={self.load.in_flight} "
            f"busy={self.busy_share:.0%} workers {change} ({self.reason})"
        )


def workers_for(demand: int, policy: QueuePolicy, busy_share: float) -> int:
    """Workers that run `demand` jobs at `busy_share` of their slots, within the bounds."""
    needed = math.ceil(demand / (policy.concurrency * busy_share)) if demand > 0 else 0
    return max(policy.floor, min(policy.max_workers, needed))


def busy_share_of(load: QueueLoad, current: int, policy: QueuePolicy) -> float:
    """Share of `current` workers' slots the queue's jobs use (in flight only)."""
    if current == 0:
        return 1.0 if load.demand else 0.0
    return min(1.0, load.in_flight / (current * policy.concurrency))


def decide(
    queue: str,
    policy: QueuePolicy,
    load: QueueLoad,
    current: int,
    memory: QueueMemory,
    now: float,
) -> Decision:
    """The desired worker count of `queue`; updates `memory` as if the change were made."""
    busy = busy_share_of(load, current, policy)
    out_target = workers_for(load.demand, policy, policy.target_busy_share)
    in_now = workers_for(load.demand, policy, policy.target_busy_share - policy.hysteresis)
    memory.recent.append((now, in_now))
    while memory.recent and memory.recent[0][0] < now - policy.scale_in_cooldown:
        memory.recent.popleft()
    in_target = max(size for _, size in memory.recent)

    def made(desired: int, reason: str) -> Decision:
        if desired > current:
            memory.last_scale_out = now
        if desired != current:
            memory.last_change = now
        return Decision(queue, current, desired, load, busy, reason)

    if current < policy.floor:
        return made(policy.floor, f"below the minimum of {policy.floor}")
    if current > policy.max_workers:
        return made(policy.max_workers, f"above the maximum of {policy.max_workers}")
    if out_target > current:
        since = None if memory.last_scale_out is None else now - memory.last_scale_out
        if since is not None and since < policy.scale_out_cooldown:
            return made(current, f"scale-out cooling down ({since:.0f}s of "
                                 f"{policy.scale_out_cooldown:.0f}s)")  # fmt: skip
        return made(out_target, f"demand {load.demand} needs {out_target}")
    if in_target < current:
        since = None if memory.last_change is None else now - memory.last_change
        if since is not None and since < policy.scale_in_cooldown:
            return made(current, f"scale-in cooling down ({since:.0f}s of "
                                 f"{policy.scale_in_cooldown:.0f}s)")  # fmt: skip
        return made(in_target, f"demand stayed low enough for {in_target}")
    if in_now < current:
        return made(current, f"holding for the scale-in window (its peak needs {in_target})")
    return made(current, "steady")
