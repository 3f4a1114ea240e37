"""The stage functions called directly on a `Runtime` over a real Redis: no Celery worker, no
HTTP. The backend pool is real; what the pool routes to is an in-memory inference client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from broker.celery_app import create_celery
from broker.jobstore import JobSpec, JobStore
from core.schemas import Backend, BackendSpec, JobStatus
from core.settings import Settings
from routing.pool import BackendPool, NoBackendError
from routing.protocol import Completion
from workers import process_state, stages, tasks
from workers.handlers.base import TaskValidationError
from workers.handlers.math import REMINDER, MathHandler
from workers.process_state import Runtime

PROMPT = [101, 102, 103]
BACKEND_ID = "fake-1"
POLICY_VERSION = 5
MATH_TASK = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 64, "seed": 7, "stop": None}
AGENT = {"max_turns": 3, "max_total_tokens": 512}


# ----------------------------------------------------------------------------- fakes


@dataclass
class Say:
    text: str
    ids: list[int]


OnCall = Callable[[int], Awaitable[None]]


class FakeClient:
    """An inference client as `RoutedPolicy` calls it: plays a script, records each request."""

    def __init__(self, script: list[Say], on_call: OnCall | None = None) -> None:
        self.script = list(script)
        self.on_call = on_call
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        self.requests.append({"prompt_ids": list(prompt_ids), **params})
        if self.on_call is not None:
            await self.on_call(len(self.requests))
        say = self.script.pop(0)
        return Completion(
            output_ids=list(say.ids),
            logprobs=[-0.5] * len(say.ids),
            text=say.text,
            finish_reason="stop",
            stop_reason=None,
            prompt_tokens=len(prompt_ids),
        )

    async def max_model_len(self) -> int:
        return 4096

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeTemplater:
    """The first prompt is `PROMPT`; each continuation is three fresh ids (900, 901, ...)."""

    def __init__(self) -> None:
        self.continued: list[list[dict[str, Any]]] = []
        self._next = 900

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return list(PROMPT)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        self.continued.append(messages)
        ids = [self._next, self._next + 1, self._next + 2]
        self._next += 3
        return ids


@dataclass
class Fleet:
    """What the job's requests reach instead of HTTP."""

    client: FakeClient
    templater: FakeTemplater
    asked: list[str]


@pytest.fixture
def rt(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, node_name="node-a", sandbox_dir=tmp_path / "boxes")
    app = create_celery(settings, redis_url)
    runtime = Runtime(
        settings=settings, store=JobStore(client), pool=BackendPool(client), celery=app
    )

    def no_http(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a stage built a real inference client")

    monkeypatch.setattr(process_state, "make_client", no_http)
    yield runtime
    if runtime._loop is not None:
        runtime._loop.close()
    app.close()
    client.close()


def serve(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch, script: list[Say], on_call: OnCall | None = None
) -> Fleet:
    """Register one backend in the pool and answer its requests from `script`."""
    rt.pool.register(
        BackendSpec(url="http://127.0.0.1:9", model="fake", id=BACKEND_ID),
        max_model_len=4096,
    )
    rt.pool.resume(BACKEND_ID, policy_version=POLICY_VERSION)
    fleet = Fleet(FakeClient(script, on_call), FakeTemplater(), [])

    def policy(backend: Backend) -> tuple[Any, Any]:
        fleet.asked.append(backend.id)
        return fleet.client, fleet.templater

    monkeypatch.setattr(rt, "policy", policy)
    return fleet


def make_job(rt: Runtime, task: dict[str, Any] | None = None) -> str:
    spec = JobSpec(
        task=task or MATH_TASK,
        data_source="math",
        instance_id="two-plus-two",
        sampling=SAMPLING,
        agent=AGENT,
        group_id="g-1",
        sample_index=2,
    )
    rt.store.create_jobs([spec])
    return spec.job_id


def assert_slot_free(rt: Runtime, job_id: str) -> None:
    assert rt.pool.backend_of(job_id) is None
    assert rt.pool.holders() == {}
    assert rt.pool.in_flight() == {BACKEND_ID: 0}


# ----------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize(("answer", "reward"), [("4", 1.0), ("5", 0.0)])
def test_a_math_job_goes_through_init_run_and_eval_to_its_reward(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch, answer: str, reward: float
) -> None:
    seen_mid_run: list[Any] = []
    job_id = make_job(rt)

    async def on_call(n: int) -> None:
        if n == 2:  # what was saved after the first turn, while the second one runs
            seen_mid_run.append(rt.store.trajectory(job_id))
            seen_mid_run.append(rt.pool.backend_of(job_id))

    fleet = serve(
        rt,
        monkeypatch,
        [Say("Let me think.", [11, 12]), Say(f"So \\boxed{{{answer}}}.", [13, 14, 15])],
        on_call,
    )

    assert stages.init_stage(rt, job_id) is True
    record = rt.store.get(job_id)
    assert record.status is JobStatus.init
    assert record.context == {
        "messages": MathHandler().initial_messages(MATH_TASK),
        "tools": None,
    }
    assert record.sandbox is None
    assert record.hosts["init"] == "node-a"
    assert "init" in record.durations
    assert fleet.client.requests == []  # INIT asks no backend

    assert stages.run_stage(rt, job_id) is True
    assert rt.store.status(job_id) is JobStatus.run
    # The trajectory was saved after each turn: the first turn and its observation were in
    # the store while the second request ran, and the job held the backend meanwhile.
    partial, held = seen_mid_run
    assert [t.type for t in partial.turns] == ["model", "env"]
    assert partial.response_ids == [11, 12, 900, 901, 902]
    assert held == BACKEND_ID
    # Requests carried the job's sampling (the seed moved on by the sample index), the
    # request ids and the prefix-cache salt of the backend's policy version.
    first, second = fleet.client.requests
    assert first["prompt_ids"] == PROMPT
    assert second["prompt_ids"] == [*PROMPT, 11, 12, 900, 901, 902]
    assert (first["request_id"], second["request_id"]) == (f"{job_id}-1", f"{job_id}-2")
    assert first["cache_salt"] == f"rollserve-policy-{POLICY_VERSION}"
    assert (first["seed"], first["max_tokens"], first["temperature"]) == (9, 64, 0.7)
    assert fleet.templater.continued == [[{"role": "user", "content": REMINDER}]]
    assert set(fleet.asked) == {BACKEND_ID}
    assert_slot_free(rt, job_id)

    ran = rt.store.trajectory(job_id)
    assert ran.status is JobStatus.run
    assert (ran.stop_reason, ran.truncated) == ("answer", False)
    assert ran.prompt_ids == PROMPT
    assert ran.response_ids == [11, 12, 900, 901, 902, 13, 14, 15]
    assert ran.loss_mask == [1, 1, 0, 0, 0, 1, 1, 1]
    assert ran.logprobs == [-0.5, -0.5, None, None, None, -0.5, -0.5, -0.5]
    assert (ran.backend_id, ran.policy_version) == (BACKEND_ID, POLICY_VERSION)
    assert ran.reward is None
    record = rt.store.get(job_id)
    assert (record.backend_id, record.policy_version) == (BACKEND_ID, POLICY_VERSION)

    assert stages.eval_stage(rt, job_id) is False  # the chain ends here
    done = rt.store.trajectory(job_id)
    assert done.status is JobStatus.completed
    assert done.reward == reward
    assert done.eval["gold"] == "4"
    assert done.eval["extracted"] == answer
    assert done.eval["reason"] == ("correct" if reward else "incorrect")
    assert done.error is None
    assert done.response_ids == ran.response_ids
    assert done.timing.init is not None and done.timing.run is not None
    assert done.timing.eval is not None
    assert done.finished_at is not None

    # A redelivered EVAL finds the job ended and records nothing again.
    assert stages.eval_stage(rt, job_id) is False
    assert rt.store.trajectory(job_id).reward == reward


# ----------------------------------------------------------------------------- failures


def test_an_eval_whose_grading_fails_ends_the_job_failed_with_its_trajectory(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A task that never passed the gateway's validation: it has no gold answer to grade by.
    job_id = make_job(rt, {"data_source": "math", "problem": "What is 2+2?"})
    serve(rt, monkeypatch, [Say("\\boxed{4}", [11])])
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id)

    with pytest.raises(TaskValidationError):
        stages.eval_stage(rt, job_id)
    assert rt.store.status(job_id) is JobStatus.eval
    assert rt.store.trajectory(job_id).reward is None

    # The stage task's adapter turns the error into the job's end, keeping what it has.
    monkeypatch.setattr(tasks, "get_runtime", lambda: rt)
    task = SimpleNamespace(request=SimpleNamespace(chain=[{"task": "next"}]))
    tasks.execute_stage(task, "eval", job_id, stages.eval_stage)
    assert task.request.chain is None
    failed = rt.store.trajectory(job_id)
    assert failed.status is JobStatus.failed
    assert failed.error is not None
    assert (failed.error.stage, failed.error.type) == ("eval", "TaskValidationError")
    assert "answer" in failed.error.message
    assert failed.reward is None
    assert failed.response_ids == [11]
    assert failed.stop_reason == "answer"
    assert_slot_free(rt, job_id)


def test_a_job_ended_between_turns_stops_and_keeps_what_it_had(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt)

    async def on_call(n: int) -> None:
        if n == 2:
            # Only the end is recorded (as a cancel on another node would): giving back the
            # backend slot is left to the run stage.
            rt.store.finish(job_id, JobStatus.cancelled)

    fleet = serve(rt, monkeypatch, [Say("Hmm.", [11]), Say("Still hmm.", [12])], on_call)
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id) is False
    assert len(fleet.client.requests) == 2
    assert_slot_free(rt, job_id)
    kept = rt.store.trajectory(job_id)
    assert kept.status is JobStatus.cancelled
    # What was saved before the end is the job's partial trajectory; nothing after it.
    assert [t.type for t in kept.turns] == ["model", "env"]
    assert kept.response_ids == [11, 900, 901, 902]


def test_a_job_cancelled_during_a_request_has_the_request_aborted(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt)

    async def on_call(n: int) -> None:
        rt.store.finish(job_id, JobStatus.cancelled)
        await asyncio.Event().wait()  # a request that would never end by itself

    fleet = serve(rt, monkeypatch, [Say("never", [1])], on_call)
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id) is False
    assert fleet.client.aborted == [f"{job_id}-1"]
    assert_slot_free(rt, job_id)
    assert rt.store.status(job_id) is JobStatus.cancelled


def test_no_stage_runs_for_a_job_that_has_ended(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt)
    fleet = serve(rt, monkeypatch, [])
    rt.store.finish(job_id, JobStatus.cancelled)
    assert stages.init_stage(rt, job_id) is False
    assert stages.run_stage(rt, job_id) is False
    assert stages.eval_stage(rt, job_id) is False
    record = rt.store.get(job_id)
    assert record.status is JobStatus.cancelled
    assert record.context is None
    assert fleet.client.requests == [] and fleet.asked == []


def test_run_without_any_backend_raises_and_holds_nothing(rt: Runtime) -> None:
    job_id = make_job(rt)
    assert stages.init_stage(rt, job_id)
    with pytest.raises(NoBackendError):
        stages.run_stage(rt, job_id)
    assert rt.pool.holders() == {}
    assert rt.store.trajectory(job_id).turns == []


def test_run_refuses_a_job_that_init_did_not_prepare(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt)
    fleet = serve(rt, monkeypatch, [])
    with pytest.raises(RuntimeError, match="without the context INIT prepares"):
        stages.run_stage(rt, job_id)
    assert fleet.client.requests == []


def test_limits_come_from_the_jobs_resolved_parameters(rt: Runtime) -> None:
    limits = stages.limits_for(rt.store.get(make_job(rt)), tool_timeout=33.0)
    assert (limits.max_turns, limits.max_total_tokens, limits.max_tokens) == (3, 512, 64)
    assert (limits.temperature, limits.top_p, limits.stop) == (0.7, 0.95, None)
    assert limits.seed == 9  # the base seed plus the sample index
    assert limits.tool_timeout == 33.0


class ClosableClient:
    """A stand-in inference client that records how it was let go."""

    def __init__(self) -> None:
        self.discarded = False
        self.closed = False

    def discard(self) -> None:
        self.discarded = True

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[ClosableClient]:
    """The clients the runtime makes, in order (stand-ins, no HTTP)."""
    clients: list[ClosableClient] = []

    def make(*_args: Any, **_kwargs: Any) -> ClosableClient:
        clients.append(ClosableClient())
        return clients[-1]

    monkeypatch.setattr(process_state, "make_client", make)
    return clients


def test_a_broken_loop_discards_its_own_clients_only(
    rt: Runtime, made: list[ClosableClient]
) -> None:
    backend = Backend(
        id="b1", url="http://127.0.0.1:9", kind="vllm", model="fake", registered_at=0.0
    )

    async def use() -> None:
        rt.policy(backend)

    rt.run(use())
    elsewhere = ClosableClient()  # a client of another loop (the jobs loop's)
    rt._clients["b2"] = ("vllm|completions|http://x|m|None|1", elsewhere, FakeTemplater())

    async def fail() -> None:
        raise RuntimeError("a time limit mid-await")

    with pytest.raises(RuntimeError):
        rt.run(fail())
    assert made[0].discarded and not made[0].closed
    assert set(rt._clients) == {"b2"} and not elsewhere.discarded


def test_a_replaced_client_is_closed_once_its_requests_are_over(
    rt: Runtime, made: list[ClosableClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process_state, "CLOSE_MARGIN", 0.05)
    rt.settings.backend_timeout = 0.05
    first = Backend(id="b1", url="http://127.0.0.1:9", kind="vllm", model="fake", registered_at=0.0)
    moved = first.model_copy(update={"url": "http://127.0.0.1:10"})

    async def use() -> None:
        rt.policy(first)
        rt.policy(first)  # the same: kept
        assert len(made) == 1
        rt.policy(moved)  # re-registered elsewhere: a new client
        assert len(made) == 2 and not made[0].closed  # its requests may still run
        await asyncio.sleep(0.3)

    rt.run(use())
    assert made[0].closed and not made[1].closed
