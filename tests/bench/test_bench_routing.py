"""bench/routing.py, the fleet simulation of backend assignment, on a tiny seeded instance."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", ROOT / "bench" / "routing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


routing = load_bench()
PARAMS = routing.Params(jobs=60, slots=16, backends=4, big=1, cache_tokens=40_000, seed=7)
POLICIES = list(routing.POLICIES)
STICKY = ["prorl-heap", "consistent-hash", "rollserve", "rollserve-unweighted"]


@pytest.fixture(scope="module")
def jobs() -> list[Any]:
    return list(routing.make_jobs(PARAMS))


def run(jobs: list[Any], policy: str) -> tuple[Any, Any]:
    """The finished simulation (with a decision trace) and its result."""
    simulation = routing.Simulation(PARAMS, jobs, policy, trace=True)
    return simulation, simulation.run()


@pytest.mark.parametrize("policy", POLICIES)
def test_every_job_finishes_exactly_once(jobs: list[Any], policy: str) -> None:
    simulation, result = run(jobs, policy)
    assert result.jobs == PARAMS.jobs
    assert result.completions == [1] * PARAMS.jobs
    for job, backends in zip(jobs, result.backend_of_job, strict=True):
        assert len(backends) == len(job.turns)
        if policy in STICKY:
            assert len(set(backends)) == 1
    assert all(not b.running and not b.waiting for b in simulation.backends)
    assert result.decode_tokens == sum(t.decode for j in jobs for t in j.turns)


def test_sticky_policies_hit_the_prefix_cache_more_than_round_robin(jobs: list[Any]) -> None:
    hit = {policy: run(jobs, policy)[1].hit_rate for policy in POLICIES}
    for policy in STICKY:
        assert hit[policy] > hit["round-robin"] + 0.2, hit
    assert 0 < hit["round-robin"] < 1


def test_count_heap_never_decrements(jobs: list[Any]) -> None:
    simulation, _ = run(jobs, "prorl-heap")
    trace = simulation.policy.trace
    assert len(trace) == PARAMS.jobs
    previous = [0.0] * PARAMS.backends
    for counts, chosen in trace:
        assert min(previous) == previous[chosen]  # took a least-assigned backend
        assert [c - p for c, p in zip(counts, previous, strict=True)] == [
            1.0 if i == chosen else 0.0 for i in range(PARAMS.backends)
        ]
        previous = list(counts)
    assert sum(previous) == PARAMS.jobs  # ending jobs gave nothing back


def test_least_loaded_sends_each_request_to_the_least_loaded_backend(jobs: list[Any]) -> None:
    simulation, result = run(jobs, "least-loaded")
    trace = simulation.policy.trace
    capacities = PARAMS.capacities()
    assert len(trace) == sum(len(b) for b in result.backend_of_job)
    uneven = 0
    for loads, chosen in trace:
        weighted = [(load + 1) / cap for load, cap in zip(loads, capacities, strict=True)]
        assert weighted[chosen] == min(weighted)
        assert chosen == weighted.index(min(weighted))  # ties to the lowest id
        uneven += len(set(loads)) > 1
    assert uneven > len(trace) / 2  # the choice was not trivial


def test_least_loaded_route_reads_current_in_flight() -> None:
    backends = [routing.Backend(i, c, PARAMS) for i, c in enumerate([1.0, 1.0, 2.0])]
    policy = routing.LeastLoaded(backends)
    job = routing.Job(0, "k", (routing.Turn(2000, 10, 0.0),))
    for index, count in enumerate([1, 0, 3]):
        for _ in range(count):
            backends[index].arrive(routing.Request(index, 0, 2000, 10), 0.0)
    assert policy.route(job) == 1  # (0+1)/1 beats (1+1)/1 and (3+1)/2
    backends[1].arrive(routing.Request(1, 0, 2000, 10), 0.0)
    assert policy.route(job) == 0  # 2/1 everywhere: the lowest id


def test_rollserve_releases_what_it_holds(jobs: list[Any]) -> None:
    simulation, _ = run(jobs, "rollserve")
    policy = simulation.policy
    assert policy.holding == [0] * PARAMS.backends
    capacities = PARAMS.capacities()
    for holding, chosen in policy.trace:
        weighted = [(h + 1) / c for h, c in zip(holding, capacities, strict=True)]
        assert chosen == weighted.index(min(weighted))


def test_results_are_deterministic_for_a_seed(jobs: list[Any]) -> None:
    for policy in POLICIES:
        first = run(jobs, policy)[1]
        again = routing.simulate(PARAMS, policy)  # jobs drawn afresh from the same seed
        assert first.summary() == again.summary()
        assert first.backend_of_job == again.backend_of_job
    other = routing.Params(**{**PARAMS.__dict__, "seed": PARAMS.seed + 1})
    assert routing.simulate(other, "rollserve").summary() != run(jobs, "rollserve")[1].summary()
