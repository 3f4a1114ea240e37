"""Checks shared by the pipeline tests against vLLM: a trajectory against what the engine
answered (through `tests.vllm.recording`), and against a teacher-forced recomputation.

Both hold for every segment of a trajectory (`core.flatten.sequences`): the built-in loop
makes one, a harness that rewrites its history several (`core.schemas.Segment`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.client import RolloutClient
from core.flatten import sequences
from core.schemas import JobStatus, ModelTurn, Segment, Trajectory
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
    assert traj.status is JobStatus.completed, (traj.error, traj.harness)
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


def describe_segments(traj: Trajectory) -> str:
    """The trajectory's segments, for a failure message: why each began, at which turn, and
    how many ids it holds."""
    return "; ".join(
        f"{segment.reason} at turn {segment.first_turn} "
        f"({len(segment.prompt_ids)} prompt + {len(segment.response_ids)} response ids)"
        for segment in sequences(traj)
    )


def _differing(recorded: list[int], engines: list[int]) -> int:
    """How many ids of `recorded` are not `engines`' (a missing or extra id counts)."""
    return sum(a != b for a, b in zip(recorded, engines, strict=False)) + abs(
        len(recorded) - len(engines)
    )


@dataclass
class EngineComparison:
    """A trajectory's ids against what the engine ran and generated (`compare_with_engine`)."""

    compared: int = 0
    """Ids compared: every call's whole prompt (sent, and as the engine ran it), every call's
    output, and every segment's recorded ids."""
    differing: int = 0
    """Of them, those that are not the engine's."""
    problems: list[str] = field(default_factory=list)
    """Every difference found (ids, logprobs, counts), one line each."""

    def check(self, what: str, recorded: list[int], engines: list[int]) -> None:
        wrong = _differing(recorded, engines)
        self.compared += max(len(recorded), len(engines))
        self.differing += wrong
        if wrong:
            self.problems.append(
                f"{what}: {wrong} ids differ ({len(recorded)} recorded, {len(engines)} engine's)"
            )


def compare_with_engine(api: str, traj: Trajectory, exchanges: list[Exchange]) -> EngineComparison:
    """Compare every model call of `traj` with the engine's exchange for it, in order: its whole
    prompt (the ids of its segment so far, or its own prompt when it begins a segment) with
    what was sent and what the engine says it ran, its output ids and logprobs with what the
    engine generated; then every segment's recorded ids with the sequence its calls made."""
    result = EngineComparison()
    model_turns = [t for t in traj.turns if isinstance(t, ModelTurn)]
    if len(exchanges) != len(model_turns):
        result.problems.append(
            f"{len(model_turns)} model calls recorded, {len(exchanges)} engine requests"
        )
        return result
    built: list[list[int]] = []  # each segment's ids as its calls made them
    for index, (turn, exchange) in enumerate(zip(model_turns, exchanges, strict=True)):
        if not built or turn.segment_start is not None:
            built.append([])
        sequence = built[-1]
        sequence += turn.prompt_ids  # a later call of a segment: the observation's ids
        prompt, output, logprobs = engine_answer(api, exchange)
        sent = exchange.request["prompt" if api == "completions" else "token_ids"]
        where = f"call {index} (segment {len(built) - 1})"
        result.check(f"{where}: prompt sent", sequence, sent)
        result.check(f"{where}: prompt the engine ran", sequence, prompt)
        result.check(f"{where}: output", turn.output_ids, output)
        if not output:
            result.problems.append(f"{where}: the engine generated nothing")
        if turn.logprobs != logprobs:
            result.problems.append(f"{where}: logprobs are not the engine's")
        sequence += turn.output_ids
    segments = sequences(traj)
    if len(segments) != len(built):
        result.problems.append(f"{len(segments)} segments recorded, the calls made {len(built)}")
    for index, (segment, ids) in enumerate(zip(segments, built, strict=False)):
        result.check(f"segment {index} ({segment.reason})", segment_ids(segment), ids)
    return result


def assert_turns_are_the_engines(api: str, traj: Trajectory, exchanges: list[Exchange]) -> None:
    """The built-in loop's one sequence: every model turn's whole prompt is what was sent and
    what the engine says it ran, its output ids and logprobs exactly the engine's, and the
    trajectory's arrays are those calls' sequence, with no later segment."""
    assert traj.segments == [], describe_segments(traj)
    comparison = compare_with_engine(api, traj, exchanges)
    assert comparison.problems == [], describe_segments(traj)


def segment_ids(segment: Segment) -> list[int]:
    """The segment's whole sequence: its prompt, then every id after it."""
    return segment.prompt_ids + segment.response_ids


def logprob_differences(traj: Trajectory, model: Any) -> list[float]:
    """|returned - recomputed| for every generated id of `traj`, in every segment, recomputed
    by `model` (transformers, float32) in one teacher-forced pass over each segment's whole
    sequence."""
    differences: list[float] = []
    for segment in sequences(traj):
        differences += segment_logprob_differences(segment, model)
    generated = sum(len(t.output_ids) for t in traj.turns if isinstance(t, ModelTurn))
    assert len(differences) == generated, describe_segments(traj)
    return differences


def segment_logprob_differences(segment: Segment, model: Any) -> list[float]:
    """`logprob_differences` of one segment."""
    import torch

    ids = segment_ids(segment)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    start = len(segment.prompt_ids)
    differences: list[float] = []
    pairs = zip(segment.loss_mask, segment.logprobs, strict=True)
    for offset, (mask, returned) in enumerate(pairs):
        if mask == 0:
            assert returned is None
            continue
        position = start + offset
        assert returned is not None
        differences.append(abs(returned - expected[position - 1, ids[position]].item()))
    assert len(differences) == sum(segment.loss_mask)
    return differences
