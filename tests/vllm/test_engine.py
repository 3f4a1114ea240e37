"""What the real engine does with rollserve's requests: prefix-cache reuse and aborts.

The stack talks to vLLM itself here (no proxy), and the engine's own `/metrics` say what
happened: `vllm:prefix_cache_hits_total` (prompt tokens served from the cache, in 128-token
blocks) and `vllm:num_requests_running`.

Rollserve salts every request with the backend's policy version (`cache_salt`
`rollserve-policy-<v>`, `workers.routed_policy.cache_salt`; no salt for a backend without a
version), so a job's later turns reuse its earlier turns' blocks on the same weights, and
nothing computed under one version (or none) is reused under another.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from tests.vllm.conftest import (
    ENDLESS,
    VllmServer,
    engine_metrics,
    registered,
    resume,
    settled_metrics,
)

pytestmark = pytest.mark.vllm

BLOCK = 128
"""vLLM's prefix-cache block, in tokens (a prompt shorter than one block never hits)."""
HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
APIS = ["completions", "generate"]


def long_problem(tag: str) -> str:
    """A math problem of some 300 tokens whose first block is unique to `tag`."""
    steps = " ".join(f"On day {i} the {tag} farmer adds {i + 2} apples." for i in range(1, 25))
    return f"[{tag}] A farmer starts with 3 apples. {steps} How many apples are there?"


def task(tag: str) -> dict[str, Any]:
    return {"data_source": "math", "instance_id": tag, "problem": long_problem(tag), "answer": "1"}


def run_job(stack: Stack, tag: str, max_turns: int, seed: int = 0) -> Trajectory:
    began = time.monotonic()
    with RolloutClient(stack.gateway_url, timeout=180) as client:
        traj = client.submit_rollout(
            task(tag),
            sampling={"temperature": 1.0, "max_tokens": 8, "seed": seed},
            agent={"max_turns": max_turns},
            wait=True,
            timeout=180,
        )
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed, traj.error
    print(f"\njob {tag} ({max_turns} turns) took {time.monotonic() - began:.1f}s")
    return traj


def hits_of(stack: Stack, vllm_server: VllmServer, tag: str, max_turns: int) -> tuple[int, Any]:
    """Run one job; the prefix-cache hits (tokens) the engine counted meanwhile, and the job."""
    before = settled_metrics(vllm_server.url)[HITS]
    traj = run_job(stack, tag, max_turns)
    return int(settled_metrics(vllm_server.url)[HITS] - before), traj


def expected_hits(traj: Trajectory) -> int:
    """The tokens each turn can take from the cache the previous turns left: every full block
    of the previous turn's computed ids (its prompt and output but the last sampled id) that
    lies inside this turn's prompt, minus the id the engine always computes."""
    turns = [t for t in traj.turns if isinstance(t, ModelTurn)]
    total, sequence, computed = 0, 0, 0
    for turn in turns:
        sequence += len(turn.prompt_ids)
        total += BLOCK * (min(computed, sequence - 1) // BLOCK)
        sequence += len(turn.output_ids)
        computed = sequence - 1
    return total


@pytest.mark.parametrize("api", APIS)
def test_later_turns_of_a_job_hit_the_prefix_cache(
    api: str, stack: Stack, vllm_server: VllmServer
) -> None:
    with registered(
        stack, vllm_server.url, vllm_server.model, api=api, backend_id=f"cache-{api}",
        policy_version=1,
    ):  # fmt: skip
        hits, traj = hits_of(stack, vllm_server, f"turns-{api}", max_turns=3)
    first = traj.turns[0]
    assert isinstance(first, ModelTurn) and len(first.prompt_ids) > 2 * BLOCK
    assert [t.type for t in traj.turns] == ["model", "env", "model", "env", "model"]
    print(f"\n{api}: 3 turns, {hits} prefix-cache hit tokens (expected {expected_hits(traj)})")
    assert hits >= 2 * 2 * BLOCK  # turns 2 and 3 each reuse at least the first prompt's blocks
    assert hits == expected_hits(traj)


def test_no_prefix_cache_reuse_across_policy_versions(
    stack: Stack, vllm_server: VllmServer
) -> None:
    tag = "versions"
    backend = {"url": vllm_server.url, "model": vllm_server.model, "api": "completions"}
    found: dict[str, int] = {}
    with registered(stack, **backend, backend_id="salted", policy_version=1):
        found["v1 first"], first = hits_of(stack, vllm_server, tag, max_turns=1)
        found["v1 again"], again = hits_of(stack, vllm_server, tag, max_turns=1)
        resume(stack, "salted", 2)
        found["v2 first"], newer = hits_of(stack, vllm_server, tag, max_turns=1)
        found["v2 again"], _ = hits_of(stack, vllm_server, tag, max_turns=1)
    with registered(stack, **backend, backend_id="unsalted"):
        found["no version"], unversioned = hits_of(stack, vllm_server, tag, max_turns=1)
    print(f"\nprefix-cache hit tokens of one-turn jobs on one prompt: {found}")
    assert [first.policy_version, again.policy_version, newer.policy_version] == [1, 1, 2]
    assert unversioned.policy_version is None
    prompt = first.turns[0]
    assert isinstance(prompt, ModelTurn)
    reusable = BLOCK * ((len(prompt.prompt_ids) - 1) // BLOCK)
    assert reusable >= 2 * BLOCK
    # The same prompt on the same weights is served from the cache; on other weights, or
    # unversioned (no salt), nothing is.
    assert found == {
        "v1 first": 0,
        "v1 again": reusable,
        "v2 first": 0,
        "v2 again": reusable,
        "no version": 0,
    }


LONG_TOKENS = 1800
"""The long job's `max_tokens`: it cannot end before, taking 10-30 s here."""


@contextmanager
def long_job(stack: Stack, vllm_server: VllmServer, api: str) -> Iterator[str]:
    """A job generating 1,800 tokens (10-30 s) on the engine through `api`, already
    generating there (the engine's token counter moving while the job is live). Its prompt
    holds `ENDLESS`, so the server's logits processor keeps it from ending by itself: a
    cancel always finds it generating."""
    with (
        registered(stack, vllm_server.url, vllm_server.model, api=api, backend_id=f"abort-{api}"),
        RolloutClient(stack.gateway_url, timeout=60) as client,
    ):
        generated0 = engine_metrics(vllm_server.url)["vllm:generation_tokens_total"]
        job_id = client.submit_rollout(
            {"data_source": "math", "instance_id": "long", "problem": f"Count.{ENDLESS}"}
            | {"answer": "1"},
            sampling={"temperature": 1.0, "max_tokens": LONG_TOKENS, "seed": 3},
            agent={"max_turns": 1},
        )
        assert isinstance(job_id, str)
        deadline = time.monotonic() + 120
        while True:
            # Not a fixed sleep: the engine's speed varies with the machine's load.
            metrics = engine_metrics(vllm_server.url)
            generating = metrics["vllm:generation_tokens_total"] - generated0
            if metrics.get(RUNNING, 0) >= 1 and generating >= 20:
                break
            status = client.get_rollout(job_id).status
            assert not status.terminal, f"the endless job ended by itself: {status}"
            assert time.monotonic() < deadline, "the job's request never ran on the engine"
            time.sleep(0.02)
        yield job_id


def cancel_and_time(stack: Stack, vllm_server: VllmServer, api: str) -> float:
    """Seconds from sending the cancel of a long job to its engine request's end, read from
    the engine while the cancel call is still answering (the gateway answers once the stage
    has stopped, which is not what is timed); that the engine aborted it (it did not run to
    its end) and that nothing runs there afterwards."""
    before = engine_metrics(vllm_server.url)["vllm:generation_tokens_total"]
    with (
        long_job(stack, vllm_server, api) as job_id,
        RolloutClient(stack.gateway_url, timeout=60) as client,
        ThreadPoolExecutor(max_workers=1) as caller,
    ):
        cancelled = time.monotonic()
        answer = caller.submit(client.cancel_rollout, job_id)
        while engine_metrics(vllm_server.url).get(RUNNING, 0) > 0:
            assert time.monotonic() - cancelled < 30, "the cancelled request ran on"
            time.sleep(0.02)
        stopped = time.monotonic() - cancelled
        assert answer.result(timeout=60).status is JobStatus.cancelled
        after = engine_metrics(vllm_server.url)
        time.sleep(0.5)
        later = engine_metrics(vllm_server.url)
        assert client.get_rollout(job_id).status is JobStatus.cancelled
    assert later.get(RUNNING, 0) == 0
    assert later["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"]
    # Stopped by the cancel, not by its end: the job's request generated fewer than its
    # 1,800 ids (it is the only request the engine ran meanwhile).
    assert later["vllm:generation_tokens_total"] - before < LONG_TOKENS
    return stopped


@pytest.mark.parametrize("api", APIS)
def test_a_cancelled_job_stops_on_the_engine(
    api: str, stack: Stack, vllm_server: VllmServer
) -> None:
    # Three cancels, each of a job that cannot end by itself (1,800 ids: 10-30 s): every one
    # must stop its request on the engine, long before that, and nothing may run there after.
    # How long it took is printed, not asserted: on this shared 2-core machine it also times
    # whatever holds the CPU then (the engine's own threads, another test's stack): about
    # 0.1-0.6 s alone, seconds while the whole suite runs.
    stops = sorted(cancel_and_time(stack, vllm_server, api) for _ in range(3))
    print(f"\n{api}: the engine stopped cancelled requests after {[round(s, 2) for s in stops]} s")
