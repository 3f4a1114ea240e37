"""Harnesses of the user's own end to end, on one stack: a program in the job's box (the openai
SDK, mini-swe-agent) talks to its job's endpoint through the box's forwarder, and a program
outside the service (the OpenAI Agents SDK) drives a session through the gateway; their calls
are recorded as the job's exact ids and the task's grader decides the reward."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import RolloutClient
from core.flatten import sequences
from core.schemas import JobStatus, SessionOpened, Trajectory
from deploy.stack import Stack
from sandbox.harnesses import MINI_SWE_AGENT, harness_env_ready, harness_python
from tests.support.procs import processes_mentioning
from tests.support.swe import BUILDER, bwrap_problem, mini_swe_agent_entries
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

needs_bwrap = pytest.mark.skipif(
    bwrap_problem() is not None, reason=str(bwrap_problem() or "bubblewrap works")
)
needs_harness_env = pytest.mark.skipif(
    not harness_env_ready(), reason="the harness environment is not built (make harness-env)"
)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


WRITE_HELLO = "echo hi > /workspace/hello.txt"
SLEEP = "sleep 100"
SCRIPT = [
    {"match": "HARNESS-SLEEP", "samples": [[call("sh", cmd=SLEEP), "Done."]]},
    {"match": "AGENTS-SDK", "samples": [[call("lookup", key="sum"), "It is \\boxed{4}."]]},
    {"match": "SESSION-WRONG", "samples": [["It is \\boxed{5}."]]},
    {
        "match": "HARNESS-FILE",
        "samples": [[call("sh", cmd="echo hi > /workspace/hello.txt"), "Done."]],
    },
]
# A harness of the user's own: the openai SDK's tool loop, run by the service's Python.
HARNESS = """
import json, os, subprocess
from openai import OpenAI

client = OpenAI(max_retries=0)
task = open(os.environ["ROLLSERVE_INSTRUCTION_FILE"]).read()
tools = [{"type": "function", "function": {"name": "sh", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
messages = [{"role": "user", "content": task}]
for _ in range(4):
    answer = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for tool_call in message.tool_calls:
        command = json.loads(tool_call.function.arguments)["cmd"]
        output = subprocess.run(command, shell=True, capture_output=True, text=True).stdout
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": output})
print("harness done after", len(messages), "messages")
"""
CHECK_HELLO = 'test "$(cat /workspace/hello.txt)" = hi'
HARNESS_TASK = {"data_source": "shell", "instruction": "HARNESS-FILE: write hi to hello.txt.",
                "check": CHECK_HELLO, "files": {"/workspace/agent.py": HARNESS}}  # fmt: skip
HARNESS_AGENT = {"command": f"{sys.executable} /workspace/agent.py"}
MATH = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}
BOX = {"data_source": "shell", "instruction": "Write hi to hello.txt.", "check": CHECK_HELLO}


@pytest.fixture(scope="module")
def swe_tasks() -> Iterator[tuple[list[dict[str, Any]], Path]]:
    """The shipped SWE example tasks, built for this module."""
    out = Path(tempfile.mkdtemp(prefix="harness-swe-"))
    yield BUILDER.build(out), out
    shutil.rmtree(out, ignore_errors=True)


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    tasks, out = request.getfixturevalue("swe_tasks")
    mini = mini_swe_agent_entries({t["instance_id"]: t["patch"] for t in tasks})
    return {
        "script": SCRIPT + mini, "sandbox_dir": data / "sandboxes", "sandbox_backend": "bwrap",
        "swe_repo_roots": str(out), "tool_timeout": 60.0, "visibility_timeout": 100.0,
        # mini-swe-agent takes seconds to start (litellm's import) before its first call.
        **{f"{stage}_{kind}": seconds for stage in ("init", "run", "eval")
           for kind, seconds in (("soft_time_limit", 80.0), ("time_limit", 90.0))},
    }  # fmt: skip


def open_session(client: RolloutClient, task: dict[str, Any]) -> SessionOpened:
    return client.open_session({"task": task})


def end(opened: SessionOpened, **body: Any) -> httpx.Response:
    """The session's end, asked over plain HTTP with its key."""
    headers = {"Authorization": f"Bearer {opened.api_key}"}
    return httpx.post(f"{opened.base_url}/end", json=body, headers=headers, timeout=30)


def finished(client: RolloutClient, job_id: str) -> Trajectory:
    wait_until(lambda: client.get_rollout(job_id).status.terminal, 60, f"job {job_id} to end")
    return client.get_rollout(job_id)


async def test_an_openai_agents_sdk_program_drives_a_session_graded_by_the_task(
    stack: Stack, client: RolloutClient
) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    looked_up: list[str] = []

    @function_tool
    def lookup(key: str) -> str:
        """Look a value up."""
        looked_up.append(key)
        return "2+2 is 4"

    opened = open_session(client, MATH)
    model = OpenAIChatCompletionsModel(
        model="policy",
        openai_client=AsyncOpenAI(base_url=opened.openai_base_url, api_key=opened.api_key),
    )
    agent = Agent(name="solver", instructions="AGENTS-SDK: use the tool.", tools=[lookup],
                  model=model)  # fmt: skip
    result = await Runner.run(agent, "What is 2+2?")
    assert looked_up == ["sum"]
    assert "\\boxed{4}" in str(result.final_output)
    assert end(opened, grade=True).status_code == 200

    traj = finished(client, opened.job_id)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0 and traj.stop_reason == "session_end"
    assert [t.type for t in traj.turns] == ["model", "env", "model"]
    assert traj.segments == [], [s.reason for s in traj.segments]
    assert traj.harness is not None and traj.harness.calls == 2
    assert opened.api_key not in traj.model_dump_json()
    logs = [p.read_text(errors="replace") for p in (stack.settings.data_dir / "logs").glob("*")]
    assert logs and not any(opened.api_key in text for text in logs)


def test_a_session_ended_with_its_own_reward_keeps_it(stack: Stack, client: RolloutClient) -> None:
    from openai import OpenAI

    opened = open_session(client, {**MATH, "problem": "SESSION-WRONG"})
    sdk = OpenAI(base_url=opened.openai_base_url, api_key=opened.api_key)
    answer = sdk.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "SESSION-WRONG: 2+2?"}]
    )
    assert answer.choices[0].message.content == "It is \\boxed{5}."
    assert end(opened, reward=0.25).status_code == 200
    traj = finished(client, opened.job_id)
    assert traj.reward == 0.25 and traj.eval == {"source": "session"}


def test_a_key_opens_only_its_own_session_and_only_while_it_runs(
    stack: Stack, client: RolloutClient
) -> None:
    from openai import AuthenticationError, NotFoundError, OpenAI

    mine = open_session(client, MATH)
    other = open_session(client, MATH)
    thief = OpenAI(base_url=mine.openai_base_url, api_key=other.api_key, max_retries=0)
    with pytest.raises(AuthenticationError):
        thief.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    assert end(mine, reward=0.0).status_code == 200
    assert end(other, reward=0.0).status_code == 200
    finished(client, mine.job_id)
    late = OpenAI(base_url=mine.openai_base_url, api_key=mine.api_key, max_retries=0)
    with pytest.raises(NotFoundError):
        late.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])


def test_a_session_refuses_agent_command_at_submission(stack: Stack) -> None:
    body = {"task": MATH, "agent": {"command": "mini"}}
    answer = httpx.post(f"{stack.gateway_url}/v1/sessions", json=body, timeout=30)
    assert answer.status_code == 422 and "agent.command" in answer.text


@needs_bwrap
def test_a_session_runs_the_tasks_tools_in_its_sandbox_and_grades_them(
    stack: Stack, client: RolloutClient
) -> None:
    opened = open_session(client, BOX)
    assert opened.tools is not None and "bash" in {t["function"]["name"] for t in opened.tools}
    ran = client.session_tool(opened, "bash", command="echo hi > hello.txt && cat hello.txt")
    assert ran["text"].strip() == "hi"
    traj = client.end_session(opened, timeout=60)
    assert traj.status is JobStatus.completed and traj.reward == 1.0, traj.error
    wait_until(lambda: processes_mentioning(traj.job_id) == [], 30, "the session's box to go")
    assert sequences(traj)[0].prompt_ids == []  # no model call was made


@needs_bwrap
def test_a_harness_in_the_box_solves_the_task_through_its_endpoint(client: RolloutClient) -> None:
    traj = client.submit_rollout(HARNESS_TASK, agent=HARNESS_AGENT, wait=True, timeout=120)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed and traj.reward == 1.0, (traj.error, traj.harness)
    assert traj.stop_reason == "harness_exit"
    harness = traj.harness
    assert harness is not None and harness.exit_code == 0 and harness.calls == 2
    assert "harness done after 4 messages" in harness.stdout
    assert [t.type for t in traj.turns] == ["model", "env", "model"]
    assert traj.segments == [], [s.reason for s in traj.segments]
    assert traj.turns[0].tool_calls == [{"name": "sh", "arguments": {"cmd": WRITE_HELLO}}]
    assert "OPENAI_API_KEY" not in traj.model_dump_json()
    wait_until(lambda: processes_mentioning(traj.job_id) == [], 30, "the job's box to go")


@needs_bwrap
def test_a_box_cannot_use_another_jobs_key(stack: Stack, client: RolloutClient) -> None:
    other = open_session(client, MATH)
    thief = {"command": f"OPENAI_API_KEY={other.api_key} {sys.executable} /workspace/agent.py"}
    traj = client.submit_rollout(HARNESS_TASK, agent=thief, wait=True, timeout=120)
    end(other, reward=0.0)
    assert isinstance(traj, Trajectory) and traj.harness is not None
    assert traj.harness.calls == 0 and traj.harness.exit_code != 0
    assert "AuthenticationError" in traj.harness.stderr
    assert traj.reward == 0.0 and traj.turns == []
    assert other.api_key not in traj.harness.stdout + traj.harness.stderr


@needs_bwrap
@needs_harness_env
def test_mini_swe_agent_in_its_box_earns_1_for_the_gold_patch_and_0_for_the_wrong_one(
    client: RolloutClient, swe_tasks: tuple[list[dict[str, Any]], Path]
) -> None:
    tasks, _ = swe_tasks
    command = (f"{harness_python()} {MINI_SWE_AGENT} --task-file $ROLLSERVE_INSTRUCTION_FILE "
               "--model openai/policy --step-limit 6")  # fmt: skip
    agent = {"command": command, "max_turns": 8}
    sampling = {"seed": 0, "max_tokens": 2048}
    accepted = client.submit_batch(tasks[:1], group_size=2, sampling=sampling, agent=agent)
    results = {t.sample_index: t for t in client.iter_batch_results(accepted.batch_id)}
    gold, wrong = results[0], results[1]
    for traj in (gold, wrong):
        assert traj.status is JobStatus.completed, (traj.error, traj.harness)
        assert traj.harness is not None and traj.harness.exit_code == 0, traj.harness
        assert traj.stop_reason == "harness_exit" and traj.segments == []
    assert (gold.reward, wrong.reward) == (1.0, 0.0), (gold.eval, wrong.eval)
    assert gold.outcome["patch"].strip() == tasks[0]["patch"].strip()
    ids = [gold.job_id, wrong.job_id]
    wait_until(lambda: all(processes_mentioning(i) == [] for i in ids), 30, "the jobs' boxes to go")


def _slow_task() -> dict[str, Any]:
    return {**HARNESS_TASK, "instruction": "HARNESS-SLEEP: take your time."}


@needs_bwrap
def test_a_cancelled_harness_job_stops_its_harness_and_leaves_nothing_behind(
    stack: Stack, client: RolloutClient
) -> None:
    job_id = client.submit_rollout(_slow_task(), agent=HARNESS_AGENT)
    assert isinstance(job_id, str)
    wait_until(lambda: len(client.get_rollout(job_id).turns) >= 1, 60, "the harness's first call")
    client.cancel_rollout(job_id)
    traj = finished(client, job_id)
    assert traj.status is JobStatus.cancelled
    wait_until(lambda: processes_mentioning(job_id) == [], 30, "the job's processes to end")


@needs_bwrap
def test_a_harness_past_the_jobs_time_budget_is_stopped_and_graded(client: RolloutClient) -> None:
    agent = {**HARNESS_AGENT, "max_seconds": 8.0}
    traj = client.submit_rollout(_slow_task(), agent=agent, wait=True, timeout=120)
    assert isinstance(traj, Trajectory)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.stop_reason == "time_budget" and traj.truncated
    assert traj.harness is not None and traj.harness.timed_out and traj.reward == 0.0


def test_a_job_that_is_no_session_is_not_relayed(stack: Stack, client: RolloutClient) -> None:
    job_id = client.submit_rollout(MATH)
    answer = httpx.get(f"{stack.gateway_url}/v1/sessions/{job_id}/v1/models", timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"


def test_the_anthropic_sdk_streams_a_sessions_answer_recorded_as_its_ids(
    client: RolloutClient,
) -> None:
    from anthropic import Anthropic

    opened = open_session(client, {**MATH, "problem": "SESSION-WRONG"})
    sdk = Anthropic(base_url=opened.anthropic_base_url, api_key=opened.api_key, max_retries=0)
    question = [{"role": "user", "content": "SESSION-WRONG: 2+2?"}]
    with sdk.messages.stream(model="policy", max_tokens=64, system="Be brief.",
                             messages=question) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "It is \\boxed{5}." and final.stop_reason == "end_turn"
    traj = client.end_session(opened, reward=0.0, timeout=60)
    assert traj.turns[0].text.startswith(text)  # the recorded text keeps the stop token
    assert final.usage.output_tokens == len(traj.turns[0].output_ids)
