"""mini-swe-agent in its job's box, on the tiny model through a real vLLM, through both of
vLLM's APIs.

The job's `agent.command` runs mini-swe-agent in its default tool-call mode, which declares
one `bash` tool; its model calls go through the job's endpoint, which renders their messages
into ids, sends the engine ids and records the ids the engine returned. The test server's
logits processor (`engine_plugins/scripted_tool_calls.py`) makes the random model call `bash`
first, then (once a tool result is in the prompt) `finish`, a tool mini-swe-agent does not
know: it answers with a format error in place of that reply, which leaves the reply out of its
history, so each later call begins a new segment. Whatever the segments, every one of them
must be exactly the ids the engine ran and generated, with logprobs a teacher-forced
recomputation of the model gives.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.schemas import ModelTurn
from deploy.stack import Stack
from sandbox.harnesses import MINI_SWE_AGENT, harness_env_ready, harness_python
from tests.support.swe import bwrap_problem
from tests.vllm.checks import (
    Run,
    compare_with_engine,
    describe_segments,
    logprob_differences,
    recorded_run,
)
from tests.vllm.conftest import TOOL_CALLS, VllmServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(bwrap_problem() is not None, reason=str(bwrap_problem())),
    pytest.mark.skipif(
        not harness_env_ready(), reason="the harness environment is not built (make harness-env)"
    ),
]

TASK = {
    "data_source": "shell",
    "instance_id": "greet-harness",
    "instruction": "Write hi into /workspace/hello.txt.",
    "check": 'test "$(cat /workspace/hello.txt)" = hi',
}
COMMAND = (
    f"{harness_python()} {MINI_SWE_AGENT} --task-file $ROLLSERVE_INSTRUCTION_FILE "
    "--model openai/policy --step-limit 6"
)
AGENT = {"command": COMMAND, "max_turns": 8}
SAMPLING = {"temperature": 1.0, "max_tokens": 128, "seed": 5}


@pytest.fixture(scope="module", params=["completions", "generate"])
def run(request: pytest.FixtureRequest, stack: Stack, vllm_server: VllmServer) -> Run:
    api: str = request.param
    return recorded_run(stack, vllm_server, api, f"harness-{api}", TASK, SAMPLING, AGENT)


def model_turns(run: Run) -> list[ModelTurn]:
    return [t for t in run.trajectory.turns if isinstance(t, ModelTurn)]


def test_mini_swe_agent_calls_bash_through_its_endpoint_and_the_job_completes(run: Run) -> None:
    traj = run.trajectory
    harness = traj.harness
    segments = describe_segments(traj)
    print(
        f"\n{run.api} (mini-swe-agent): {traj.stop_reason}, reward {traj.reward}, "
        f"{harness.calls if harness else 0} calls; segments: {segments}"
    )
    assert harness is not None and harness.calls >= 1, (harness, segments)
    assert harness.calls == len(model_turns(run)), (harness, segments)
    assert model_turns(run)[0].tool_calls == TOOL_CALLS[:1], segments


def test_every_segment_is_exactly_what_the_engine_ran_and_generated(run: Run) -> None:
    comparison = compare_with_engine(run.api, run.trajectory, run.exchanges)
    segments = describe_segments(run.trajectory)
    print(
        f"\n{run.api} (mini-swe-agent): {comparison.differing} of {comparison.compared} ids "
        f"differ from the engine's; segments: {segments}"
    )
    assert comparison.problems == [], segments
    assert comparison.differing == 0 and comparison.compared > 0, segments


def test_logprobs_of_every_segment_equal_a_teacher_forced_float32_recomputation(
    run: Run, hf_model: Any
) -> None:
    differences = logprob_differences(run.trajectory, hf_model)
    segments = describe_segments(run.trajectory)
    largest = max(differences)
    print(
        f"\n{run.api} (mini-swe-agent): {len(differences)} logprobs, largest difference "
        f"{largest:.3g}; segments: {segments}"
    )
    assert largest <= 1e-3, segments
