"""Checks shared by the pipeline tests against vLLM: a trajectory against what the engine
answered (through `tests.vllm.recording`), and against a teacher-forced recomputation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.client import RolloutClient
from core.schemas import JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from routing.vllm_generate import GENERATE_PATH
from tests.vllm.conftest import VllmServer, registered
from tests.vllm.recording import Exchange, recording_proxy

PATHS = {"completions": "/v1/completions", "generate": GENERATE_PATH}
"""The engine's route for each `api` of a backend."""


@dataclass(frozen=True)
class Run:
    """One completed job whose backend was vLLM behind a recording proxy."""

    api: str
    trajectory: Trajectory
    exchanges: list[Exchange]
    """The engine's completions, in order."""


def recorded_run(
    stack: Stack,
    server: VllmServer,
    api: str,
    backend_id: str,
    task: dict[str, Any],
    sampling: dict[str, Any],
    agent: dict[str, Any],
) -> Run:
    """Run `task` to its end on `server` through `api`, recording what the engine answered."""
    with (
        recording_proxy(server.url) as proxy,
        registered(stack, proxy.url, server.model, api=api, backend_id=backend_id),
        RolloutClient(stack.gateway_url, timeout=180) as client,
    ):
        traj = client.submit_rollout(task, sampling=sampling, agent=agent, wait=True, timeout=180)
        exchanges = proxy.recorded(PATHS[api])
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed, traj.error
    return Run(api, traj, exchanges)


def engine_answer(api: str, exchange: Exchange) -> tuple[list[int], list[int], list[float]]:
    """What the engine said: the prompt ids it ran, the ids it generated, their logprobs."""
    assert exchange.status == 200, exchange.answer
    answer: dict[str, Any] = exchange.answer
    choice = answer["choices"][0]
    if api == "completions":
        return choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return answer["prompt_token_ids"], choice["token_ids"], logprobs


def assert_turns_are_the_engines(api: str, traj: Trajectory, exchanges: list[Exchange]) -> None:
    """Every model turn's whole prompt is what was sent and what the engine says it ran; its
    output ids and logprobs are exactly the engine's."""
    model_turns = [t for t in traj.turns if isinstance(t, ModelTurn)]
    assert len(exchanges) == len(model_turns)
    sequence: list[int] = []
    for turn, exchange in zip(model_turns, exchanges, strict=True):
        sequence += turn.prompt_ids  # after the first turn: the observation's ids
        prompt, output, logprobs = engine_answer(api, exchange)
        sent = exchange.request["prompt" if api == "completions" else "token_ids"]
        assert sent == prompt == sequence
        assert turn.output_ids == output and len(output) > 0
        assert turn.logprobs == logprobs
        sequence += turn.output_ids
    assert sequence == traj.prompt_ids + traj.response_ids


def logprob_differences(traj: Trajectory, model: Any) -> list[float]:
    """|returned - recomputed| for every generated id of `traj`, recomputed by `model`
    (transformers, float32) in one teacher-forced pass over the whole sequence."""
    import torch

    ids = traj.prompt_ids + traj.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    start = len(traj.prompt_ids)
    differences: list[float] = []
    for offset, (mask, returned) in enumerate(zip(traj.loss_mask, traj.logprobs, strict=True)):
        if mask == 0:
            assert returned is None
            continue
        position = start + offset
        assert returned is not None
        differences.append(abs(returned - expected[position - 1, ids[position]].item()))
    assert len(differences) == sum(traj.loss_mask)
    return differences
