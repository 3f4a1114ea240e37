"""Weight updates on a real vLLM (its CPU build): rollserve's worker extension loads a
checkpoint directory through the development-mode `/collective_rpc`, between `/pause` and
`/resume`, and the prefix cache is reset; the gateway's `update_weights` does it mid-job."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.client import RolloutClient
from core.schemas import Backend, JobStatus, ModelTurn
from deploy.stack import Stack
from routing.restarts import engine_started
from routing.weights import WeightUpdateError, load_weights
from tests.support.wait import wait_until
from tests.support.weights import WeightDirs, max_diff, teacher_forced
from tests.vllm.conftest import SHELL_TASK, VllmServer, registered, settled_metrics

pytestmark = pytest.mark.vllm

PROMPT = list(range(2000, 2300))
"""300 ids: two full blocks of vLLM's 128-token prefix cache."""
HITS = "vllm:prefix_cache_hits_total"
LOAD_TIMEOUT = 300.0


def as_backend(server: VllmServer) -> Backend:
    return Backend(id="real", url=server.url, kind="vllm", model=server.model, registered_at=0)


def load(server: VllmServer, path: Any) -> float:
    return asyncio.run(load_weights(as_backend(server), str(path), timeout=LOAD_TIMEOUT))


@pytest.fixture
def restored(vllm_server: VllmServer, weight_dirs: WeightDirs) -> Iterator[VllmServer]:
    """The session's server, given back with the weights every other test expects."""
    yield vllm_server
    httpx.post(f"{vllm_server.url}/resume", timeout=60)
    load(vllm_server, weight_dirs.original)


def complete(server: VllmServer) -> tuple[list[int], list[float]]:
    """Greedy ids and logprobs for `PROMPT` (no cache salt: the prefix cache is shared)."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    body |= {"logprobs": 0, "return_token_ids": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_new_weights_serve_logprobs_equal_to_a_float32_recomputation(
    restored: VllmServer, weight_dirs: WeightDirs
) -> None:
    server = restored
    ids, lps = complete(server)
    assert max_diff(lps, teacher_forced(weight_dirs.original, PROMPT, ids)) < 1e-3
    hits = settled_metrics(server.url).get(HITS, 0.0)
    complete(server)
    assert settled_metrics(server.url).get(HITS, 0.0) > hits  # the prompt is cached

    seconds = load(server, weight_dirs.perturbed)
    assert seconds > 0
    hits = settled_metrics(server.url).get(HITS, 0.0)
    new_ids, new_lps = complete(server)
    # The cache was reset: nothing computed under the old weights served this prompt.
    assert settled_metrics(server.url).get(HITS, 0.0) == hits
    # Every weight changed, the output layer tied to the embeddings too (vLLM's own
    # reload leaves the CPU build's prepacked copy of it behind; the extension redoes it).
    assert max_diff(new_lps, teacher_forced(weight_dirs.perturbed, PROMPT, new_ids)) < 1e-3
    assert max_diff(new_lps, teacher_forced(weight_dirs.original, PROMPT, new_ids)) > 1e-2

    load(server, weight_dirs.original)
    assert complete(server)[0] == ids
    assert max_diff(complete(server)[1], lps) < 1e-4


def test_a_checkpoint_of_another_shape_is_refused_and_the_engine_serves_on(
    restored: VllmServer, weight_dirs: WeightDirs
) -> None:
    server = restored
    before = complete(server)
    with pytest.raises(WeightUpdateError) as caught:
        load(server, weight_dirs.mismatched)
    assert "refused" in str(caught.value) and "intermediate_size" in str(caught.value)
    assert httpx.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": False}
    ids, lps = complete(server)
    assert ids == before[0] and max_diff(lps, before[1]) < 1e-4


SAMPLING = {"temperature": 1.0, "max_tokens": 48, "seed": 5}


@pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)
def test_the_gateway_switches_the_weights_mid_job_and_later_turns_record_the_version(
    stack: Stack, restored: VllmServer, weight_dirs: WeightDirs
) -> None:
    server = restored
    # Two model turns whatever the weights (a bash call sleeping 3 s, then finish): the job is
    # certainly between its turns when the switch lands, never done before it.
    task = SHELL_TASK
    with (
        registered(
            stack, server.url, server.model, api="completions", backend_id="switch",
            policy_version=1,
        ),
        RolloutClient(stack.gateway_url, timeout=120) as client,
    ):  # fmt: skip
        sampling = {**SAMPLING, "max_tokens": 64}  # room for the whole scripted call
        job_id = client.submit_rollout(task, sampling=sampling, agent={"max_turns": 8})
        assert isinstance(job_id, str)
        wait_until(
            lambda: any(isinstance(t, ModelTurn) for t in client.get_rollout(job_id).turns),
            180,
            "a first model turn",
        )
        report = client.update_weights(str(weight_dirs.perturbed), policy_version=2, timeout=300)
        assert report.ok, report.error
        [switch] = report.backends
        assert switch.id == "switch" and switch.load_seconds is not None
        print(
            f"\nswitch: drain {switch.drain_seconds:.2f}s, load {switch.load_seconds:.2f}s, "
            f"total {switch.total_seconds:.2f}s"
        )
        assert client.list_backends()[0].policy_version == 2
        wait_until(lambda: client.get_rollout(job_id).status.terminal, 300, "the job to end")
        traj = client.get_rollout(job_id)
    assert traj.status is JobStatus.completed, traj.error
    model_turns = [t for t in traj.turns if isinstance(t, ModelTurn)]
    versions = [t.policy_version for t in model_turns]
    assert versions == sorted(versions) and set(versions) == {1, 2}, versions
    # The turns of version 2 were generated by the new weights: their logprobs are the new
    # model's, recomputed over the whole sequence (the generated ids are the masked ones, in
    # the order of the model turns).
    ids = traj.prompt_ids + traj.response_ids
    generated = [len(traj.prompt_ids) + i for i, m in enumerate(traj.loss_mask) if m == 1]
    returned = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 1]
    owners = [t.policy_version for t in model_turns for _ in t.output_ids]
    assert len(owners) == len(generated)
    newer = [i for i, version in enumerate(owners) if version == 2]
    assert newer
    recomputed = sequence_logprobs(weight_dirs.perturbed, ids)
    assert max(abs((returned[i] or 0.0) - recomputed[generated[i]]) for i in newer) < 1e-3


def sequence_logprobs(model_dir: Any, ids: list[int]) -> list[float]:
    """Logprob of each id of `ids` given those before it (0.0 for the first), in float32."""
    return [0.0, *teacher_forced(model_dir, ids[:1], ids[1:])]


def test_vllm_says_when_its_process_started(vllm_server: VllmServer) -> None:
    # What the health sweep reads to tell a restarted engine (routing.restarts): a restart
    # of the real server is the development server's end-to-end test
    # (tests/e2e/test_survival.py); here, that vLLM offers the reading it relies on.
    started = engine_started(as_backend(vllm_server))
    assert started is not None
    assert time.time() - 3600 < started < time.time() - vllm_server.ready_seconds + 60
    assert engine_started(as_backend(vllm_server)) == started
