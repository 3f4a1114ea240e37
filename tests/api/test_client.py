"""The Python client over real HTTP, against a small gateway look-alike served by uvicorn.

The look-alike answers with the shapes of the real routes (FastAPI's own validation 422s, a
401 from the token check, NDJSON streaming with keep-alive blank lines) and records what it
was sent, so these tests check both the requests and the parsing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from api.client import (
    AsyncRolloutClient,
    RolloutClient,
    RolloutServiceError,
    render_detail,
)
from core.schemas import (
    Backend,
    BackendSpec,
    BatchAccepted,
    BatchProgress,
    BatchRequest,
    Health,
    JobStatus,
    RolloutRequest,
    SamplingParams,
    Stats,
    Trajectory,
)
from tests.support.gateway import serve
from tests.support.jobs import make_trajectory

TOKEN = "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """State of the look-alike: what it was sent, and knobs the tests turn."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.backends: dict[str, Backend] = {}
        self.release_second = threading.Event()
        self.second_sent = threading.Event()
        self.stream_pause = 0.0


def make_app(gw: Gateway) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        body = await request.body()
        gw.requests.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": dict(request.query_params),
                "auth": request.headers.get("authorization"),
                "json": json.loads(body) if body else None,
            }
        )
        response: Response = await call_next(request)
        return response

    def auth(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            raise HTTPException(401, "missing or wrong bearer token")

    @app.get("/healthz")
    def healthz() -> Health:
        return Health(status="ok", redis=True, backends=len(gw.backends))

    @app.get("/v1/stats", dependencies=[Depends(auth)])
    def stats() -> Stats:
        return Stats(
            queues={"init": 1, "run": 2, "eval": 0},
            jobs={"completed": 5},
            busy={"run": 1},
            workers={"init": 1, "run": 1, "eval": 1},
            backends={"a": 1},
            completed_last_minute=5,
            throughput_per_s=0.08,
        )

    @app.post("/v1/rollouts", dependencies=[Depends(auth)], status_code=202)
    def submit(body: RolloutRequest, wait: bool = False, timeout: float | None = None) -> Any:
        if wait and body.task.data_source != "slow":
            return JSONResponse(
                make_trajectory("job-1", instance_id=body.task.instance_id or "made-up")
            )
        return {"job_id": "job-1"}

    @app.get("/v1/rollouts/{job_id}", dependencies=[Depends(auth)])
    def get_rollout(job_id: str) -> Any:
        if job_id != "job-1":
            raise HTTPException(404, f"no job {job_id!r}")
        return make_trajectory(job_id, status="run", reward=None)

    @app.delete("/v1/rollouts/{job_id}", dependencies=[Depends(auth)])
    def cancel_rollout(job_id: str) -> Any:
        return make_trajectory(
            job_id,
            status="cancelled",
            reward=None,
            error={"stage": "run", "type": "cancelled", "message": "cancelled by the user"},
        )

    @app.post("/v1/batches", dependencies=[Depends(auth)], status_code=202)
    def submit_batch(body: BatchRequest) -> BatchAccepted:
        jobs = [f"b1-{i}" for i in range(len(body.tasks) * body.group_size)]
        return BatchAccepted(batch_id="b1", jobs=jobs)

    def progress(batch_id: str, done: bool) -> BatchProgress:
        return BatchProgress(
            batch_id=batch_id,
            total=2,
            group_size=2,
            counts={"completed": 2} if done else {"run": 2},
            finished=2 if done else 0,
            groups_total=1,
            groups_finished=1 if done else 0,
            mean_reward=0.5 if done else None,
            done=done,
            created_at=1.0,
        )

    @app.get("/v1/batches/{batch_id}", dependencies=[Depends(auth)])
    def batch_progress(batch_id: str) -> BatchProgress:
        return progress(batch_id, done=True)

    @app.delete("/v1/batches/{batch_id}", dependencies=[Depends(auth)])
    def cancel_batch(batch_id: str) -> BatchProgress:
        return progress(batch_id, done=False)

    @app.get("/v1/batches/{batch_id}/results", dependencies=[Depends(auth)])
    def results(batch_id: str) -> StreamingResponse:
        if batch_id != "b1":
            raise HTTPException(404, f"no batch {batch_id!r}")

        async def lines() -> AsyncIterator[bytes]:
            yield (json.dumps(make_trajectory("b1-0", reward=1.0)) + "\n").encode()
            yield b"\n"  # keep-alive
            # Hold the second result until the client has seen the first: a client that
            # buffered the whole response would never see it.
            for _ in range(500):
                if gw.release_second.is_set():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(gw.stream_pause)
            yield b"\n"
            gw.second_sent.set()
            yield (json.dumps(make_trajectory("b1-1", reward=0.0)) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/backends", dependencies=[Depends(auth)], status_code=201)
    def register(spec: BackendSpec) -> Backend:
        backend = Backend(
            id=spec.id or "derived",
            url=spec.url,
            kind=spec.kind,
            model=spec.model,
            policy_version=spec.policy_version,
            registered_at=1.0,
        )
        gw.backends[backend.id] = backend
        return backend

    @app.get("/v1/backends", dependencies=[Depends(auth)])
    def list_backends() -> list[Backend]:
        return list(gw.backends.values())

    @app.delete("/v1/backends/{backend_id}", dependencies=[Depends(auth)], status_code=204)
    def remove(backend_id: str) -> Response:
        if gw.backends.pop(backend_id, None) is None:
            raise HTTPException(404, f"no backend {backend_id!r}")
        return Response(status_code=204)

    return app


@pytest.fixture
def fake_gateway() -> Iterator[tuple[Gateway, str]]:
    gw = Gateway()
    with serve(make_app(gw)) as url:
        yield gw, url


@pytest.fixture
def fake_client(fake_gateway: tuple[Gateway, str]) -> Iterator[RolloutClient]:
    with RolloutClient(fake_gateway[1], token=TOKEN, timeout=10) as c:
        yield c


# ---------------------------------------------------------------------------- sync client


def test_health_and_stats(fake_client: RolloutClient, fake_gateway: tuple[Gateway, str]) -> None:
    gw, _ = fake_gateway
    assert fake_client.health() == Health(status="ok", redis=True, backends=0)
    stats = fake_client.stats()
    assert stats.queues["run"] == 2 and stats.throughput_per_s == pytest.approx(0.08)
    assert gw.requests[-1]["auth"] == f"Bearer {TOKEN}"


def test_defaults_come_from_the_environment(
    fake_gateway: tuple[Gateway, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, url = fake_gateway
    monkeypatch.setenv("ROLLSERVE_URL", url + "/")
    monkeypatch.setenv("ROLLSERVE_API_TOKEN", TOKEN)
    with RolloutClient() as c:
        assert c.url == url
        c.stats()
    assert gw.requests[-1]["auth"] == f"Bearer {TOKEN}"
    monkeypatch.delenv("ROLLSERVE_URL")
    with RolloutClient() as c:
        assert c.url == "http://127.0.0.1:8600"


def test_unauthorized_is_a_readable_error(fake_gateway: tuple[Gateway, str]) -> None:
    with (
        RolloutClient(fake_gateway[1], token="wrong") as c,
        pytest.raises(RolloutServiceError) as err,
    ):
        c.stats()
    assert err.value.status_code == 401
    assert err.value.detail == "missing or wrong bearer token"
    assert "401" in str(err.value) and "ROLLSERVE_API_TOKEN" in str(err.value)


def test_submit_rollout_returns_job_id(
    fake_client: RolloutClient, fake_gateway: tuple[Gateway, str]
) -> None:
    gw, _ = fake_gateway
    job = fake_client.submit_rollout(
        {"data_source": "math", "instance_id": "t1", "question": "1+1?"},
        sampling=SamplingParams(temperature=0.7, seed=3),
        agent={"max_turns": 4},
    )
    assert job == "job-1"
    sent = gw.requests[-1]
    assert sent["method"] == "POST" and sent["path"] == "/v1/rollouts"
    assert sent["query"] == {}
    assert sent["json"] == {
        "task": {"data_source": "math", "instance_id": "t1", "question": "1+1?"},
        "sampling": {"temperature": 0.7, "top_p": 1.0, "seed": 3},
        "agent": {"max_turns": 4},
    }


def test_submit_rollout_wait(fake_client: RolloutClient, fake_gateway: tuple[Gateway, str]) -> None:
    gw, _ = fake_gateway
    done = fake_client.submit_rollout(
        {"data_source": "math", "instance_id": "t1"}, wait=True, timeout=5
    )
    assert isinstance(done, Trajectory)
    assert done.status is JobStatus.completed and done.instance_id == "t1"
    assert done.logprobs == [-0.5, -0.25, None]
    assert gw.requests[-1]["query"] == {"wait": "true", "timeout": "5.0"}
    # Still running when the server stops waiting: the id comes back.
    assert fake_client.submit_rollout({"data_source": "slow"}, wait=True) == "job-1"
    assert gw.requests[-1]["query"] == {"wait": "true"}


def test_get_and_cancel_rollout(fake_client: RolloutClient) -> None:
    running = fake_client.get_rollout("job-1")
    assert running.status is JobStatus.run and running.reward is None
    assert [t.type for t in running.turns] == ["model", "env"]
    cancelled = fake_client.cancel_rollout("job-1")
    assert cancelled.status is JobStatus.cancelled
    assert cancelled.error is not None and cancelled.error.type == "cancelled"
    with pytest.raises(RolloutServiceError) as err:
        fake_client.get_rollout("nope")
    assert err.value.status_code == 404
    assert str(err.value) == "HTTP 404: no job 'nope'"


def test_validation_error_names_the_field(fake_client: RolloutClient) -> None:
    with pytest.raises(RolloutServiceError) as err:
        fake_client.submit_batch([{"data_source": "math"}, {"question": "no source"}], group_size=2)
    assert err.value.status_code == 422
    assert isinstance(err.value.detail, list)
    assert "tasks.1.data_source: Field required" in str(err.value)
    with pytest.raises(RolloutServiceError, match=r"sampling\.temperature: "):
        fake_client.submit_batch([{"data_source": "math"}], sampling={"temperature": -1})


def test_batch_submit_progress_cancel(
    fake_client: RolloutClient, fake_gateway: tuple[Gateway, str]
) -> None:
    gw, _ = fake_gateway
    accepted = fake_client.submit_batch(
        [{"data_source": "math", "instance_id": "a"}], group_size=2, agent={"max_turns": 2}
    )
    assert accepted == BatchAccepted(batch_id="b1", jobs=["b1-0", "b1-1"])
    assert gw.requests[-1]["json"] == {
        "tasks": [{"data_source": "math", "instance_id": "a"}],
        "group_size": 2,
        "agent": {"max_turns": 2},
    }
    progress = fake_client.batch_progress("b1")
    assert progress.done and progress.mean_reward == 0.5
    cancelled = fake_client.cancel_batch("b1")
    assert not cancelled.done
    assert gw.requests[-1]["method"] == "DELETE" and gw.requests[-1]["path"] == "/v1/batches/b1"


def test_batch_results_stream_line_by_line(
    fake_gateway: tuple[Gateway, str],
) -> None:
    gw, url = fake_gateway
    gw.stream_pause = 0.6  # longer than the client's timeout: streaming has no read deadline
    seen: list[str] = []
    with RolloutClient(url, token=TOKEN, timeout=0.3) as c:
        for trajectory in c.iter_batch_results("b1"):
            seen.append(trajectory.job_id)
            if len(seen) == 1:
                assert not gw.second_sent.is_set()
                gw.release_second.set()
    assert seen == ["b1-0", "b1-1"]


def test_batch_results_error_status(fake_client: RolloutClient) -> None:
    with pytest.raises(RolloutServiceError) as err:
        list(fake_client.iter_batch_results("missing"))
    assert err.value.status_code == 404 and "no batch" in str(err.value)


def test_backends(fake_client: RolloutClient, fake_gateway: tuple[Gateway, str]) -> None:
    gw, _ = fake_gateway
    backend = fake_client.register_backend(
        "http://gpu-1:8000", "qwen3-8b", policy_version=2, id="g1"
    )
    assert backend.id == "g1" and backend.policy_version == 2 and backend.kind == "vllm"
    assert gw.requests[-1]["json"] == {
        "url": "http://gpu-1:8000",
        "model": "qwen3-8b",
        "kind": "vllm",
        "id": "g1",
        "policy_version": 2,
    }
    assert gw.requests[-1]["query"] == {}
    fake_client.register_backend("http://gpu-2:8000", "qwen3-8b", kind="sglang", verify=False)
    assert gw.requests[-1]["query"] == {"verify": "false"}
    assert [b.id for b in fake_client.list_backends()] == ["g1", "derived"]
    assert fake_client.remove_backend("g1") is None
    with pytest.raises(RolloutServiceError) as err:
        fake_client.remove_backend("g1")
    assert err.value.status_code == 404
    assert [b.id for b in fake_client.list_backends()] == ["derived"]


def test_unreachable_gateway_says_how_to_start_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with RolloutClient(url, timeout=2) as c, pytest.raises(RolloutServiceError) as err:
        c.health()
    assert err.value.status_code is None
    assert url in str(err.value) and "rollserve up" in str(err.value)
    with (
        RolloutClient(url, timeout=2) as c,
        pytest.raises(RolloutServiceError, match="rollserve up"),
    ):
        list(c.iter_batch_results("b1"))


def test_render_detail() -> None:
    detail = [
        {"loc": ["body", "tasks", 3, "data_source"], "msg": "Field required", "type": "missing"},
        {"loc": ["query", "timeout"], "msg": "Input should be a valid number"},
    ]
    assert render_detail(detail) == (
        "tasks.3.data_source: Field required; query.timeout: Input should be a valid number"
    )
    assert render_detail("plain") == "plain"
    assert render_detail({"why": 1}) == '{"why": 1}'


# --------------------------------------------------------------------------- async client


async def test_async_client_round_trip(fake_gateway: tuple[Gateway, str]) -> None:
    gw, url = fake_gateway
    async with AsyncRolloutClient(url, token=TOKEN, timeout=10) as c:
        assert (await c.health()).status == "ok"
        assert (await c.stats()).workers == {"init": 1, "run": 1, "eval": 1}
        assert await c.submit_rollout({"data_source": "math"}) == "job-1"
        done = await c.submit_rollout({"data_source": "math"}, wait=True, timeout=1)
        assert isinstance(done, Trajectory) and done.reward == 1.0
        assert (await c.get_rollout("job-1")).status is JobStatus.run
        assert (await c.cancel_rollout("job-1")).status is JobStatus.cancelled
        accepted = await c.submit_batch([{"data_source": "math"}], group_size=2)
        assert accepted.jobs == ["b1-0", "b1-1"]
        assert (await c.batch_progress("b1")).done
        assert not (await c.cancel_batch("b1")).done
        await c.register_backend("http://gpu-1:8000", "m", id="g1")
        assert [b.id for b in await c.list_backends()] == ["g1"]
        await c.remove_backend("g1")
        assert await c.list_backends() == []
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in gw.requests)


async def test_async_stream_and_errors(fake_gateway: tuple[Gateway, str]) -> None:
    gw, url = fake_gateway
    gw.release_second.set()
    async with AsyncRolloutClient(url, token=TOKEN, timeout=10) as c:
        seen = [t.job_id async for t in c.iter_batch_results("b1")]
        assert seen == ["b1-0", "b1-1"]
        with pytest.raises(RolloutServiceError) as err:
            await c.submit_batch([{"data_source": ""}])
        assert err.value.status_code == 422
        assert str(err.value).startswith("HTTP 422: tasks.0.data_source: ")
        with pytest.raises(RolloutServiceError, match="no batch"):
            async for _ in c.iter_batch_results("missing"):
                pass
    async with AsyncRolloutClient(url, token=None) as c:
        with pytest.raises(RolloutServiceError) as err:
            await c.stats()
        assert err.value.status_code == 401


async def test_async_unreachable_gateway() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncRolloutClient(url, timeout=2) as c:
        with pytest.raises(RolloutServiceError, match="rollserve up"):
            await c.health()
