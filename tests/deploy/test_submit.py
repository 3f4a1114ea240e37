"""`rollserve submit` / `status` logic: reading task files, one batch end to end over real HTTP."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from rich.console import Console

from api.client import RolloutClient, RolloutServiceError
from core.schemas import (
    Backend,
    BatchAccepted,
    BatchProgress,
    BatchRequest,
    Stats,
    Trajectory,
)
from deploy.submit import (
    SubmitInputError,
    read_tasks,
    read_tasks_numbered,
    render_status,
    render_summary,
    submit_and_collect,
    summarize,
)
from tests.support.gateway import serve
from tests.support.jobs import make_trajectory


def write(tmp_path: Path, text: str | bytes, name: str = "tasks.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=140, force_terminal=False, color_system=None), buffer


# ------------------------------------------------------------------------------ read_tasks


def test_read_tasks_good_file_with_blank_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"data_source": "math", "instance_id": "a", "question": "1+1"}\n'
        "\n"
        "   \n"
        '{"data_source": "stem", "choices": ["x", "y"]}\n'
        '{"data_source": "math"}',  # no final newline
    )
    tasks = read_tasks(path)
    assert [t["data_source"] for t in tasks] == ["math", "stem", "math"]
    assert tasks[0]["question"] == "1+1" and tasks[1]["choices"] == ["x", "y"]
    assert read_tasks_numbered(path)[1] == [1, 4, 5]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"data_source": "math",}', "not valid JSON: "),
        ("not json at all", "not valid JSON: "),
        ('["data_source", "math"]', "not a JSON object (found an array)"),
        ('"math"', "not a JSON object (found a string)"),
        ("3", "not a JSON object (found a number)"),
        ('{"instance_id": "x"}', 'no "data_source"'),
        ('{"data_source": ""}', '"data_source" must be a non-empty string (found "")'),
        ('{"data_source": "  "}', '"data_source" must be a non-empty string'),
        ('{"data_source": 3}', '"data_source" must be a non-empty string (found 3)'),
        ('{"data_source": null}', '"data_source" must be a non-empty string (found null)'),
    ],
)
def test_read_tasks_bad_line_names_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = write(tmp_path, '{"data_source": "math"}\n\n' + line + '\n{"data_source": "math"}\n')
    with pytest.raises(SubmitInputError) as err:
        read_tasks(path)
    assert str(err.value).startswith(f"{path}:3: {expected}")
    assert len(err.value.problems) == 1


def test_read_tasks_lists_every_bad_line(tmp_path: Path) -> None:
    lines = ['{"data_source": "math"}', "{", '{"x": 1}'] + ["[]"] * 12
    with pytest.raises(SubmitInputError) as err:
        read_tasks(write(tmp_path, "\n".join(lines)))
    assert len(err.value.problems) == 14
    message = str(err.value)
    assert ":2: not valid JSON" in message and ':3: no "data_source"' in message
    assert message.endswith("(and 4 more bad lines)")


def test_read_tasks_file_problems(tmp_path: Path) -> None:
    with pytest.raises(SubmitInputError, match="no such file"):
        read_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(SubmitInputError, match="no tasks"):
        read_tasks(write(tmp_path, "\n\n  \n", "empty.jsonl"))
    with pytest.raises(SubmitInputError, match=r"bin\.jsonl:2: not UTF-8"):
        read_tasks(write(tmp_path, b'{"data_source": "math"}\n{"x": "\xff"}\n', "bin.jsonl"))
    bom = write(tmp_path, '\ufeff{"data_source": "math"}\n', "bom.jsonl")
    assert read_tasks(bom) == [{"data_source": "math"}]


# ------------------------------------------------------------------------- the look-alike


class BatchGateway:
    """A gateway look-alike for one batch; tasks say their per-sample rewards (`rewards`)."""

    def __init__(self) -> None:
        self.batch_request: dict[str, Any] | None = None
        self.jobs: dict[str, dict[str, Any]] = {}
        self.connections = 0
        self.fetched: list[str] = []
        self.cut_first_stream_after: int | None = None
        self.abort_first_stream = False
        self.never_streamed: set[str] = set()
        self.results_status = 200

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/batches", status_code=202)
        def submit(body: BatchRequest) -> BatchAccepted:
            self.batch_request = body.model_dump(mode="json", exclude_none=True)
            for i, task in enumerate(body.tasks):
                extra = task.model_extra or {}
                for j in range(body.group_size):
                    rewards = extra.get("rewards", [1.0] * body.group_size)
                    reward = rewards[j]
                    status = "completed" if reward is not None else "failed"
                    error = (
                        None
                        if reward is not None
                        else {"stage": "run", "type": "BackendError", "message": "boom"}
                    )
                    job_id = f"job-{i}-{j}"
                    self.jobs[job_id] = make_trajectory(
                        job_id,
                        group_id=f"g{i}",
                        instance_id=task.instance_id or f"task{i}",
                        data_source=task.data_source,
                        batch_id="batch-1",
                        sample_index=j,
                        status=status,
                        reward=reward,
                        error=error,
                    )
            return BatchAccepted(batch_id="batch-1", jobs=list(self.jobs))

        @app.get("/v1/batches/{batch_id}")
        def progress(batch_id: str) -> BatchProgress:
            # Not done until the stream has been opened twice, so a cut stream is reopened.
            done = self.connections >= 2 or (
                self.cut_first_stream_after is None and not self.abort_first_stream
            )
            return BatchProgress(
                batch_id=batch_id,
                total=len(self.jobs),
                group_size=1,
                counts={},
                finished=len(self.jobs) if done else 0,
                groups_total=1,
                groups_finished=0,
                mean_reward=None,
                done=done,
                created_at=0.0,
            )

        @app.get("/v1/rollouts/{job_id}")
        def get_rollout(job_id: str) -> dict[str, Any]:
            self.fetched.append(job_id)
            return self.jobs[job_id]

        @app.get("/v1/batches/{batch_id}/results")
        def results(batch_id: str) -> StreamingResponse:
            if self.results_status != 200:
                raise HTTPException(self.results_status, "the job store is unavailable")
            self.connections += 1
            first = self.connections == 1
            # Streamed in reverse, so the summary has to restore the submission order.
            order = [j for j in reversed(self.jobs) if j not in self.never_streamed]

            async def lines() -> AsyncIterator[bytes]:
                for n, job_id in enumerate(order):
                    if first and n == self.cut_first_stream_after:
                        if self.abort_first_stream:
                            raise RuntimeError("connection lost")
                        return
                    yield (json.dumps(self.jobs[job_id]) + "\n").encode()
                    yield b"\n"
                    await asyncio.sleep(0)

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        return app


@pytest.fixture
def batch_gateway() -> Iterator[tuple[BatchGateway, RolloutClient]]:
    gw = BatchGateway()
    with serve(gw.app()) as url, RolloutClient(url, timeout=10) as client:
        yield gw, client


TASKS = [
    {"data_source": "math", "instance_id": "easy", "rewards": [1.0, 1.0]},
    {"data_source": "math", "instance_id": "mixed", "rewards": [0.0, 1.0]},
    {"data_source": "stem", "instance_id": "hard", "rewards": [0.0, None]},
]


def read_out(path: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------ submit_and_collect


def test_submit_and_collect_writes_results_and_summarizes(
    batch_gateway: tuple[BatchGateway, RolloutClient], tmp_path: Path
) -> None:
    gw, client = batch_gateway
    out = tmp_path / "results" / "out.jsonl"
    con, buffer = console()
    summary = submit_and_collect(
        client,
        TASKS,
        group_size=2,
        out=out,
        sampling={"temperature": 0.6},
        agent={"max_turns": 3},
        console=con,
    )
    assert gw.batch_request is not None
    assert gw.batch_request["group_size"] == 2
    assert gw.batch_request["sampling"]["temperature"] == 0.6
    assert gw.batch_request["agent"] == {"max_turns": 3}
    assert gw.connections == 1

    written = read_out(out)
    assert sorted(t.job_id for t in written) == sorted(gw.jobs)
    assert not list(out.parent.glob(".*partial"))

    assert summary.batch_id == "batch-1" and summary.total == 6 and summary.received == 6
    assert summary.by_status == {"completed": 5, "failed": 1}
    assert summary.mean_reward == pytest.approx(3 / 5)
    assert summary.per_source == {"math": (4, 0.75), "stem": (2, 0.0)}
    assert [(r.instance_id, r.rewards, r.mean) for r in summary.per_task] == [
        ("easy", [1.0, 1.0], 1.0),
        ("mixed", [0.0, 1.0], 0.5),
        ("hard", [0.0, None], 0.0),
    ]
    assert (summary.solved_any, summary.solved_all, summary.informative) == (2, 1, 1)
    assert summary.out == out
    assert "batch batch-1" in buffer.getvalue()


def test_server_422_is_reported_with_the_jsonl_line(
    batch_gateway: tuple[BatchGateway, RolloutClient], tmp_path: Path
) -> None:
    gw, client = batch_gateway
    path = write(
        tmp_path,
        '{"data_source": "math"}\n\n\n{"data_source": "math", "instance_id": 5}\n',
    )
    tasks, lines = read_tasks_numbered(path)
    out = tmp_path / "out.jsonl"
    with pytest.raises(SubmitInputError) as err:
        submit_and_collect(
            client,
            tasks,
            group_size=1,
            out=out,
            console=console()[0],
            line_numbers=lines,
            source=str(path),
        )
    assert str(err.value).startswith(f"{path}:4: instance_id: Input should be a valid string")
    assert not out.exists()
    assert gw.connections == 0
    # Without a file name the line is still given; a field outside the tasks is named as is.
    with pytest.raises(SubmitInputError) as err:
        submit_and_collect(
            client,
            tasks,
            group_size=1,
            out=out,
            sampling={"temperature": -1},
            console=console()[0],
            line_numbers=lines,
        )
    problems = err.value.problems
    assert "line 4: instance_id: Input should be a valid string" in problems
    assert any(p.startswith("sampling.temperature: ") for p in problems)


@pytest.mark.parametrize("abort", [False, True], ids=["stream-ended", "connection-lost"])
def test_stream_cut_short_is_reopened_without_duplicates(
    batch_gateway: tuple[BatchGateway, RolloutClient], tmp_path: Path, abort: bool
) -> None:
    gw, client = batch_gateway
    gw.cut_first_stream_after = 2
    gw.abort_first_stream = abort
    out = tmp_path / "out.jsonl"
    summary = submit_and_collect(client, TASKS, group_size=2, out=out, console=console()[0])
    assert gw.connections == 2
    job_ids = [t.job_id for t in read_out(out)]
    assert len(job_ids) == 6 and set(job_ids) == set(gw.jobs)
    assert summary.received == 6


def test_jobs_missing_from_a_finished_stream_are_fetched(
    batch_gateway: tuple[BatchGateway, RolloutClient], tmp_path: Path
) -> None:
    gw, client = batch_gateway
    gw.never_streamed = {"job-1-0", "job-2-1"}
    out = tmp_path / "out.jsonl"
    summary = submit_and_collect(client, TASKS, group_size=2, out=out, console=console()[0])
    assert sorted(gw.fetched) == ["job-1-0", "job-2-1"]
    assert {t.job_id for t in read_out(out)} == set(gw.jobs)
    assert summary.by_status == {"completed": 5, "failed": 1}


def test_failure_leaves_no_half_written_output(
    batch_gateway: tuple[BatchGateway, RolloutClient], tmp_path: Path
) -> None:
    gw, client = batch_gateway
    gw.results_status = 503
    out = tmp_path / "out.jsonl"
    out.write_text("previous run\n")
    with pytest.raises(RolloutServiceError) as err:
        submit_and_collect(client, TASKS, group_size=2, out=out, console=console()[0])
    assert err.value.status_code == 503
    assert out.read_text() == "previous run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# ------------------------------------------------------------------------------ rendering


def trajectories() -> list[Trajectory]:
    data = [
        ("a", "math", 0, 1.0, "completed"),
        ("a", "math", 1, 0.0, "completed"),
        ("b", "code", 0, None, "timed_out"),
        ("b", "code", 1, 1.0, "completed"),
    ]
    return [
        Trajectory.model_validate(
            make_trajectory(
                f"{g}{i}",
                group_id=g,
                instance_id=f"inst-{g}",
                data_source=src,
                sample_index=i,
                reward=r,
                status=st,
            )
        )
        for g, src, i, r, st in data
    ]


def test_summarize_orders_tasks_by_submission() -> None:
    summary = summarize("b", trajectories(), total=5, job_order=["b0", "b1", "a0", "a1"])
    assert [r.instance_id for r in summary.per_task] == ["inst-b", "inst-a"]
    assert summary.per_task[0].rewards == [None, 1.0]
    assert summary.by_status == {"completed": 3, "timed_out": 1}
    assert summary.mean_reward == pytest.approx(2 / 3)
    assert summary.received == 4 and summary.total == 5


def test_render_summary() -> None:
    summary = summarize("b-7", trajectories(), total=4, job_order=["a0"], group_size=2)
    summary.out = Path("out.jsonl")
    con, buffer = console()
    render_summary(summary, con)
    text = buffer.getvalue()
    assert "batch b-7" in text and "inst-a" in text and "inst-b" in text
    assert "1 0" in text and "— 1" in text
    assert "code" in text and "math" in text
    assert "jobs: 4/4 (3 completed, 1 timed_out)" in text
    assert "mean reward: 0.6667" in text
    assert "pass@2: 2/2 tasks" in text and "all 2 solved: 0/2" in text
    assert "informative groups: 1/2" in text

    con, buffer = console()
    render_summary(summary, con, max_rows=1)
    assert "1 more tasks (all in out.jsonl)" in buffer.getvalue()


def test_render_status() -> None:
    stats = Stats(
        queues={"init": 3, "run": 0, "eval": 1, "extra": 2},
        jobs={"completed": 10, "failed": 2, "run": 1},
        busy={"run": 4},
        workers={"init": 1, "run": 2},
        backends={"gpu-1-8000": 4},
        completed_last_minute=7,
        throughput_per_s=0.12,
    )
    backends = [
        Backend(
            id="gpu-1-8000",
            url="http://gpu-1:8000",
            kind="vllm",
            model="qwen3-8b",
            policy_version=3,
            in_flight=4,
            registered_at=0.0,
        )
    ]
    con, buffer = console()
    render_status(stats, backends, con)
    text = buffer.getvalue()
    assert text.index("init") < text.index("run") < text.index("eval") < text.index("extra")
    assert "jobs: 1 run, 10 completed, 2 failed" in text
    assert "0.12 jobs/s" in text and "7 completed in the last minute" in text
    assert "gpu-1-8000" in text and "qwen3-8b" in text and "http://gpu-1:8000" in text

    con, buffer = console()
    render_status(stats, [], con)
    assert "no inference backend registered" in buffer.getvalue()
