"""The backend fleet end to end: a backend killed mid-batch, a backend drained for a weight
update and resumed with a new policy version, on a real stack with two development servers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from broker.processes import stop_group
from core.schemas import Backend, JobStatus, ModelTurn, Trajectory
from deploy.stack import Stack
from tests.support.devserver import DevBackend, start_devservers
from tests.support.stub import Answer, StubServer
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

TURNS = ["Let me think about it.", "Still thinking, carefully.", "Almost there.", "\\boxed{6}"]
SCRIPT: list[dict[str, Any]] = [
    {"match": "FLEET", "samples": [TURNS] * 64, "delay": 0.25},
]


def fleet_task(i: int) -> dict[str, str]:
    return {
        "data_source": "math",
        "instance_id": f"fleet-{i}",
        "problem": f"FLEET {i}: what is 2 times 3?",
        "answer": "6",
    }


@pytest.fixture(scope="module")
def fleet_servers(
    request: pytest.FixtureRequest, tiny_model_dir: Path, devserver_workdir: Path
) -> dict[str, DevBackend]:
    specs = {name: (SCRIPT, []) for name in ("fleet-a", "fleet-b", "fleet-c")}
    return start_devservers(request.config, tiny_model_dir, devserver_workdir, specs)


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT,
        "workers": {"init": 1, "run": 4, "eval": 1},
        "health_interval": 0.3,
        "health_failures": 2,
        "backend_retries": 1,
        "run_soft_time_limit": 40,
        "run_time_limit": 45,
        "visibility_timeout": 50,
        # SGLang backends render chat templates with this tokenizer, loaded only from here
        "tokenizer_roots": str(request.getfixturevalue("tiny_model_dir")),
    }


@pytest.fixture
def client_without_backends(stack: Stack) -> Iterator[RolloutClient]:
    with RolloutClient(stack.gateway_url, timeout=60) as c:
        for backend in c.list_backends():
            c.remove_backend(backend.id)
        yield c
        for backend in c.list_backends():
            c.remove_backend(backend.id)


def register(client_without_backends: RolloutClient, server: DevBackend, **extra: Any) -> Backend:
    return client_without_backends.register_backend(
        server.url, server.model, id=server.name, **extra
    )


def model_turns(traj: Trajectory) -> list[ModelTurn]:
    return [t for t in traj.turns if isinstance(t, ModelTurn)]


def finished(
    client_without_backends: RolloutClient, batch_id: str, timeout: float = 120
) -> list[Trajectory]:
    wait_until(
        lambda: client_without_backends.batch_progress(batch_id).done, timeout, f"batch {batch_id}"
    )
    return list(client_without_backends.iter_batch_results(batch_id))


def assert_all_right(results: list[Trajectory]) -> None:
    wrong = [
        (t.status, t.reward, t.error, [m.text for m in model_turns(t)])
        for t in results
        if t.status != JobStatus.completed or t.reward != 1.0
    ]
    assert wrong == []


class CountingServer(StubServer):
    """Listens where a dead backend was: `/health` answers 503 (so it stays dead), and every
    other request is counted — none may arrive."""

    def __init__(self, port: int) -> None:
        self.requests: list[str] = []
        super().__init__(self.answer, port)

    def answer(self, method: str, path: str) -> Answer:
        if path != "/health":
            self.requests.append(f"{method} {path}")
        return 503, {}, b""


def test_a_backend_killed_mid_batch_loses_no_job(
    client_without_backends: RolloutClient, fleet_servers: dict[str, DevBackend]
) -> None:
    a, b = fleet_servers["fleet-a"], fleet_servers["fleet-b"]
    register(client_without_backends, a)
    register(client_without_backends, b)
    batch = client_without_backends.submit_batch([fleet_task(i) for i in range(8)], group_size=1)
    # Kill it once it has answered a few turns, with jobs still holding it.
    wait_until(
        lambda: (
            b.metric("vllm:request_success_total") >= 2
            and client_without_backends.list_backends()[1].in_flight >= 1
        ),
        60,
        "turns answered by fleet-b",
    )
    stop_group(b.proc)  # SIGTERM then SIGKILL to its process group: the server is gone
    wait_until(
        lambda: (
            {x.id: x.state for x in client_without_backends.list_backends()}["fleet-b"] == "dead"
        ),
        30,
        "fleet-b marked dead",
    )
    # Requests already under way when it died finish their own retries (at most ~1 s with
    # ROLLSERVE_BACKEND_RETRIES=1); from then on nothing may be sent to it.
    time.sleep(1.5)
    port = int(b.url.rsplit(":", 1)[1])
    listener = CountingServer(port)
    try:
        results = finished(client_without_backends, batch.batch_id)
    finally:
        listener.close()
    assert len(results) == 8
    assert_all_right(results)
    # Nothing is sent to a dead backend once it is detected (health probes aside).
    assert listener.requests == []
    moved = [t for t in results if {m.backend_id for m in model_turns(t)} == {"fleet-a", "fleet-b"}]
    assert moved, [[m.backend_id for m in model_turns(t)] for t in results]
    for traj in moved:
        # The turn was not lost: the record is whole, four model turns in order.
        assert [m.text.removesuffix("<|im_end|>") for m in model_turns(traj)] == TURNS
    assert all(x.in_flight == 0 for x in client_without_backends.list_backends())


def test_a_drained_backend_gets_no_new_work_then_resumes_with_a_new_version(
    client_without_backends: RolloutClient, fleet_servers: dict[str, DevBackend]
) -> None:
    a, c = fleet_servers["fleet-a"], fleet_servers["fleet-c"]
    register(client_without_backends, a, policy_version=1)
    register(client_without_backends, c, policy_version=1)
    batch = client_without_backends.submit_batch(
        [fleet_task(100 + i) for i in range(8)], group_size=1
    )
    wait_until(
        lambda: (
            {x.id: x.in_flight for x in client_without_backends.list_backends()}["fleet-c"] >= 1
        ),
        30,
        "a job on fleet-c",
    )
    drained = client_without_backends.drain_backend("fleet-c", wait=30)
    assert isinstance(drained, Backend)
    assert drained.state == "draining" and drained.idle and drained.in_flight == 0
    served_at_drain = c.metric("vllm:request_success_total")
    results = finished(client_without_backends, batch.batch_id)
    assert_all_right(results)
    # Running requests finished; nothing new reached the drained backend.
    assert c.metric("vllm:request_success_total") == served_at_drain
    assert client_without_backends.list_backends()[1].in_flight == 0

    # The trainer swaps the weights and resumes every backend at version 2.
    client_without_backends.drain_backend(None, wait=30)
    resumed = client_without_backends.resume_backend(None, policy_version=2)
    assert isinstance(resumed, list) and {x.state for x in resumed} == {"healthy"}
    after = finished(
        client_without_backends,
        client_without_backends.submit_batch([fleet_task(200 + i) for i in range(4)]).batch_id,
    )
    versions = {m.policy_version for t in after for m in model_turns(t)}
    assert versions == {2} and {t.policy_version for t in after} == {2}
    assert {t.backend_id for t in after} == {"fleet-a", "fleet-c"}
    earlier = {m.policy_version for t in results for m in model_turns(t)}
    assert earlier == {1}


@pytest.mark.parametrize(
    "registration",
    [
        {"kind": "vllm", "api": "generate"},
        {"kind": "sglang", "tokenizer": "TINY"},
    ],
    ids=["vllm-generate", "sglang"],
)
def test_every_api_gives_the_same_record(
    client_without_backends: RolloutClient,
    fleet_servers: dict[str, DevBackend],
    tiny_model_dir: Path,
    registration: dict[str, Any],
) -> None:
    a = fleet_servers["fleet-a"]
    register(client_without_backends, a)
    task = fleet_task(300)
    reference = client_without_backends.submit_rollout(
        task, sampling={"seed": 0}, wait=True, timeout=60
    )
    assert isinstance(reference, Trajectory) and reference.status == JobStatus.completed
    client_without_backends.remove_backend(a.name)
    extra = dict(registration)
    if extra.get("tokenizer") == "TINY":
        extra["tokenizer"] = str(tiny_model_dir)  # SGLang: chat templates rendered locally
    backend = register(client_without_backends, a, **extra)
    assert (backend.kind, backend.api) == (extra["kind"], extra.get("api", "completions"))
    other = client_without_backends.submit_rollout(
        task, sampling={"seed": 0}, wait=True, timeout=60
    )
    assert isinstance(other, Trajectory) and other.status == JobStatus.completed
    assert other.reward == reference.reward == 1.0
    assert other.prompt_ids == reference.prompt_ids
    assert other.response_ids == reference.response_ids
    assert other.loss_mask == reference.loss_mask
    assert [m.finish_reason for m in model_turns(other)] == ["stop"] * len(TURNS)
    for mine, theirs in zip(other.logprobs, reference.logprobs, strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None and theirs is not None:
            assert abs(mine - theirs) < 1e-4
