"""The autoscaling policy: bounds, targets, cool-downs, scale to zero and hysteresis."""

from __future__ import annotations

import pytest

from deploy.autoscale.policy import (
    QueueLoad,
    QueueMemory,
    QueuePolicy,
    decide,
    default_policy,
    workers_for,
)

POLICY = QueuePolicy(
    min_workers=0,
    max_workers=10,
    concurrency=2,
    target_busy_share=0.5,
    hysteresis=0.25,
    scale_out_cooldown=10.0,
    scale_in_cooldown=30.0,
)


def test_a_backlog_scales_out_to_fill_the_target_share_of_slots() -> None:
    # 12 jobs, 2 per worker at half load: 12 workers, capped at 10.
    decision = decide("init", POLICY, QueueLoad(10, 2), 1, QueueMemory(), 0.0)
    assert (decision.current, decision.desired) == (1, 10)
    decision = decide("init", POLICY, QueueLoad(3, 0), 1, QueueMemory(), 0.0)
    assert decision.desired == 3


def test_no_worker_and_a_waiting_job_starts_one_even_on_an_empty_fleet() -> None:
    decision = decide("eval", POLICY, QueueLoad(1, 0), 0, QueueMemory(), 0.0)
    assert decision.desired == 1 and decision.busy_share == 1.0


def test_a_second_scale_out_waits_for_its_cool_down() -> None:
    memory = QueueMemory()
    assert decide("run", POLICY, QueueLoad(2, 0), 0, memory, 0.0).desired == 2
    held = decide("run", POLICY, QueueLoad(8, 0), 2, memory, 5.0)
    assert held.desired == 2 and "cooling down" in held.reason
    assert decide("run", POLICY, QueueLoad(8, 0), 2, memory, 10.0).desired == 8


def test_init_and_eval_scale_to_zero_when_idle_and_run_keeps_one() -> None:
    idle = QueueLoad(0, 0)
    for queue in ("init", "eval"):
        policy = default_policy(queue, scale_in_cooldown=0.0)
        assert decide(queue, policy, idle, 3, QueueMemory(), 0.0).desired == 0
    run = default_policy("run", scale_in_cooldown=0.0)
    assert decide("run", run, idle, 3, QueueMemory(), 0.0).desired == 1
    # Even told min 0, RUN keeps one unless it may scale to zero.
    run_min0 = default_policy("run", min_workers=0, scale_in_cooldown=0.0)
    assert decide("run", run_min0, idle, 3, QueueMemory(), 0.0).desired == 1
    run_zero = default_policy("run", min_workers=0, scale_to_zero=True, scale_in_cooldown=0.0)
    assert decide("run", run_zero, idle, 3, QueueMemory(), 0.0).desired == 0


def test_the_bounds_are_restored_whatever_the_demand() -> None:
    bounded = QueuePolicy(min_workers=2, max_workers=3, scale_in_cooldown=0.0)
    assert decide("init", bounded, QueueLoad(0, 0), 0, QueueMemory(), 0.0).desired == 2
    assert decide("init", bounded, QueueLoad(0, 0), 5, QueueMemory(), 0.0).desired == 3
    assert decide("init", bounded, QueueLoad(100, 0), 2, QueueMemory(), 0.0).desired == 3


def test_scale_in_waits_for_the_cool_down_after_the_last_change() -> None:
    memory = QueueMemory(last_change=0.0)
    held = decide("init", POLICY, QueueLoad(0, 0), 8, memory, 29.0)
    assert held.desired == 8 and "scale-in cooling down" in held.reason
    assert decide("init", POLICY, QueueLoad(0, 0), 8, memory, 31.0).desired == 0


def test_scale_in_covers_the_largest_demand_of_its_window() -> None:
    memory = QueueMemory(last_change=-100.0)
    # Demand 4 at t=0, nothing afterwards: the window still remembers 4 until t=30.
    steady = decide("init", POLICY, QueueLoad(0, 4), 8, memory, 0.0)
    assert steady.desired == workers_for(4, POLICY, 0.25) == 8
    held = decide("init", POLICY, QueueLoad(0, 0), 8, memory, 20.0)
    assert held.desired == 8 and "scale-in window" in held.reason
    assert decide("init", POLICY, QueueLoad(0, 0), 8, memory, 31.0).desired == 0


def test_hysteresis_keeps_a_fleet_that_scaling_out_would_not_have_grown_to() -> None:
    # 6 jobs: scaling out sizes for half the slots (6 workers of 2); scaling in only goes
    # below what a quarter share needs (12), so a fleet of 8 stays.
    memory = QueueMemory()
    load = QueueLoad(0, 6)
    assert decide("init", POLICY, load, 8, memory, 100.0).desired == 8
    assert decide("init", POLICY, load, 2, QueueMemory(), 100.0).desired == 6


def test_a_steady_fleet_is_left_alone() -> None:
    decision = decide("run", POLICY, QueueLoad(0, 2), 2, QueueMemory(), 0.0)
    assert decision.delta == 0 and decision.reason == "steady"
    assert "workers 2 (steady)" in decision.describe()
    assert decision.busy_share == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"min_workers": 3, "max_workers": 2},
        {"min_workers": -1},
        {"concurrency": 0},
        {"target_busy_share": 0.0},
        {"target_busy_share": 1.5},
        {"hysteresis": 0.8},
        {"scale_in_cooldown": -1.0},
    ],
)
def test_a_policy_that_cannot_work_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        QueuePolicy(**bad)  # type: ignore[arg-type]
