"""The console's pages rendered in-process: batches, a batch, fleet, backends, the viewer."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from broker.jobstore import JobSpec
from core.schemas import SEGMENT_REASONS, JobStatus

MakeBatch = Callable[[int, int], tuple[str, list[JobSpec]]]


def test_batches_are_listed_newest_first(app_client: TestClient, make_batch: MakeBatch) -> None:
    older, _ = make_batch(1, 2)
    newer, _ = make_batch(1, 2)
    page = app_client.get("/ui/batches")
    assert page.status_code == 200
    assert page.text.index(newer[:12]) < page.text.index(older[:12])


def test_batch_page_shows_progress_histogram_and_group_verdicts(
    app_client: TestClient, make_batch: MakeBatch, finish: Callable[..., None]
) -> None:
    batch_id, specs = make_batch(3, 2)
    finish(specs[0], 1.0)
    finish(specs[1], 0.0)  # group 0: informative
    finish(specs[2], 1.0)
    finish(specs[3], 1.0)  # group 1: uniform; group 2 not finished
    page = app_client.get(f"/ui/batches/{batch_id}")
    assert page.status_code == 200
    assert re.search(r'id="finished">4<', page.text)
    assert "1 informative" in page.text and "1 uniform" in page.text
    assert page.text.count('class="verdict-informative">informative<') == 1
    assert 'id="histogram"' in page.text
    assert page.text.count("<rect") == 10  # ten bins between reward 0 and 1
    assert 'hx-trigger="every 2s"' in page.text  # still running: it polls
    assert 'id="cancel-batch"' in page.text


def test_job_table_filters_by_status(
    app_client: TestClient, make_batch: MakeBatch, finish: Callable[..., None]
) -> None:
    batch_id, specs = make_batch(2, 2)
    finish(specs[1], 0.5, JobStatus.failed)
    failed = app_client.get(f"/ui/batches/{batch_id}/jobs", params={"status": "failed"})
    assert failed.status_code == 200
    assert specs[1].job_id in failed.text
    assert all(s.job_id not in failed.text for s in (specs[0], specs[2], specs[3]))
    queued = app_client.get(f"/ui/batches/{batch_id}/jobs", params={"status": "queued"})
    assert sum(s.job_id in queued.text for s in specs) == 3


def test_viewer_marks_generated_tokens_by_the_loss_mask(
    app_client: TestClient, make_batch: MakeBatch, finish: Callable[..., None]
) -> None:
    _, specs = make_batch(1, 1)
    finish(specs[0], 1.0)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert page.status_code == 200
    assert 'id="generated-count">4<' in page.text
    assert 'id="ids-only"' in page.text  # no backend with a local tokenizer: ids only
    assert f'href="/v1/rollouts/{specs[0].job_id}"' in page.text
    tokens = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens")
    assert tokens.text.count('class="tok gen') == 4
    assert tokens.text.count('class="tok obs') == 4  # 3 prompt ids and 1 observation id
    # the later policy version is underlined apart from the first
    assert re.findall(r"tok gen (pv\d)", tokens.text) == ["pv1", "pv1", "pv2", "pv2"]
    turns = app_client.get(f"/ui/rollouts/{specs[0].job_id}/turns")
    assert "observation text" in turns.text
    assert turns.text.count("newversion") == 1


def test_viewer_says_why_a_job_did_not_complete(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    from core.schemas import StageError

    _, specs = make_batch(1, 1)
    error = StageError(stage="run", type="BackendError", message="the backend went away")
    store.finish(specs[0].job_id, JobStatus.failed, error=error)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert 'id="why"' in page.text
    assert "the backend went away" in page.text and "BackendError" in page.text


def test_long_trajectory_ships_its_tokens_in_chunks(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    from tests.ui.conftest import trajectory_of

    _, specs = make_batch(1, 1)
    n = 100_000
    long = trajectory_of(
        specs[0],
        1.0,
        prompt_ids=[1] * 10,
        response_ids=[2] * n,
        loss_mask=[1] * n,
        logprobs=[-0.1] * n,
        turns=[],
    )
    store.finish(specs[0].job_id, JobStatus.completed, long)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert page.text.count('class="tok') < 5  # only the legend: tokens come in chunks
    first = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens")
    assert first.text.count('class="tok') == 1000
    assert "tokens?start=1000" in first.text
    last = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens", params={"start": n})
    assert last.text.count('class="tok') == 10
    assert "tokens?start=" not in last.text


def test_fleet_page_shows_queues_and_throughput(app_client: TestClient) -> None:
    page = app_client.get("/ui/fleet")
    assert page.status_code == 200
    for queue in ("init", "run", "eval"):
        assert f"<td>{queue}</td>" in page.text
    assert 'id="throughput"' in page.text


def test_backends_page_drains_and_resumes(app_client: TestClient) -> None:
    pool = app_client.app.state.services.pool  # type: ignore[attr-defined]
    from core.schemas import BackendSpec

    pool.register(BackendSpec(url="http://127.0.0.1:9", model="m", id="b0"))
    page = app_client.get("/ui/backends")
    assert 'id="state-b0">healthy<' in page.text
    csrf = app_client.cookies["rollserve_csrf"]
    answer = app_client.post("/ui/backends/b0/drain", data={"csrf": csrf}, follow_redirects=False)
    assert answer.status_code == 303
    assert pool.get("b0").state == "draining"
    app_client.post("/ui/backends/b0/resume", data={"csrf": csrf})
    assert pool.get("b0").state == "healthy"
    engine = app_client.get("/ui/backends/b0/engine")
    assert engine.status_code == 200 and "did not answer" in engine.text


def test_viewer_shows_each_code_test_and_the_failing_swe_tests_with_the_patch(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    from tests.ui.conftest import trajectory_of

    _, specs = make_batch(1, 2)
    code = trajectory_of(
        specs[0],
        0.0,
        eval={
            "method": "tests",
            "tests": [
                {"test": 0, "kind": "stdio", "verdict": "pass"},
                {"test": 1, "kind": "stdio", "verdict": "wrong_answer", "message": "got 3"},
            ],
        },
    )
    store.finish(specs[0].job_id, JobStatus.completed, code)
    swe = trajectory_of(
        specs[1],
        0.0,
        eval={"FAIL_TO_PASS": {"success": [], "failure": ["tests/test_x.py::test_bug"]}},
        outcome={"patch": "diff --git a/x.py b/x.py\n+fixed = True\n"},
    )
    store.finish(specs[1].job_id, JobStatus.completed, swe)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert 'id="eval-tests"' in page.text
    assert "wrong_answer" in page.text and "got 3" in page.text
    page = app_client.get(f"/ui/rollouts/{specs[1].job_id}")
    assert "FAIL_TO_PASS: 0 pass, 1 fail" in page.text
    assert "tests/test_x.py::test_bug" in page.text
    assert "+fixed = True" in page.text


def test_a_batch_whose_record_expired_leaves_the_listing(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    kept, _ = make_batch(1, 1)
    gone, _ = make_batch(1, 1)
    store.r.delete(f"{store.p}batch:{gone}")  # as its TTL would
    page = app_client.get("/ui/batches")
    assert kept[:12] in page.text and gone[:12] not in page.text
    assert store.batch_count() == 1


def test_viewer_decodes_tokens_with_the_backends_local_tokenizer(
    app_client: TestClient,
    make_batch: MakeBatch,
    store: Any,
    tiny_model_dir: Any,
    tiny_tokenizer: Any,
) -> None:
    from core.schemas import BackendSpec
    from tests.ui.conftest import trajectory_of

    services = app_client.app.state.services  # type: ignore[attr-defined]
    # the model's directory is one the operator allows tokenizers from
    services.settings.tokenizer_roots = str(tiny_model_dir)
    services.pool.register(
        BackendSpec(url="http://127.0.0.1:9", model=str(tiny_model_dir), id="local")
    )
    _, specs = make_batch(1, 1)
    hello = tiny_tokenizer.encode("hello world")
    trajectory = trajectory_of(
        specs[0],
        1.0,
        backend_id="local",
        prompt_ids=hello,
        response_ids=[],
        loss_mask=[],
        logprobs=[],
        turns=[],
    )
    store.finish(specs[0].job_id, JobStatus.completed, trajectory)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert 'id="ids-only"' not in page.text
    tokens = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens")
    assert ">hello<" in tokens.text and "> world<" in tokens.text
    assert 'title="#1 id ' in tokens.text and "&#34; world&#34;" in tokens.text  # quoted, escaped


def test_viewer_reads_no_tokenizer_outside_the_allowed_roots(
    app_client: TestClient, make_batch: MakeBatch, store: Any, tiny_model_dir: Any
) -> None:
    from core.schemas import BackendSpec
    from tests.ui.conftest import trajectory_of

    pool = app_client.app.state.services.pool  # type: ignore[attr-defined]
    pool.register(BackendSpec(url="http://127.0.0.1:9", model=str(tiny_model_dir), id="local"))
    _, specs = make_batch(1, 1)
    store.finish(
        specs[0].job_id, JobStatus.completed, trajectory_of(specs[0], 1.0, backend_id="local")
    )
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert 'id="ids-only"' in page.text


def two_segments(spec: JobSpec) -> Any:
    """A trajectory whose harness edited its history after two model calls: the third call's
    prompt (5 ids) does not extend the sequence, so it begins segment 2; the arrays are
    derived from the turns as the job store derives them."""
    from core.flatten import fill_flat
    from tests.ui.conftest import trajectory_of

    def model(prompt: list[int], output: list[int], version: int, **more: Any) -> dict[str, Any]:
        return {
            "type": "model", "prompt_ids": prompt, "output_ids": output,
            "logprobs": [-0.5] * len(output), "finish_reason": "stop", "text": f"said {output}",
            "policy_version": version, **more,
        }  # fmt: skip

    turns = [
        model([11, 12, 13], [14, 15], 1),
        {"type": "env", "observation_ids": [16], "text": "observation text"},
        model([16], [17, 18], 2),  # a later call's prompt: the observation before it
        model([11, 12, 13, 30, 31], [40, 41], 2, segment_start="history_changed"),
        {"type": "env", "observation_ids": [42], "text": "second observation"},
        model([42], [43], 3),
    ]
    return fill_flat(trajectory_of(spec, 1.0, turns=turns))


def test_viewer_shows_where_each_segment_begins_and_why(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    _, specs = make_batch(1, 1)
    store.finish(specs[0].job_id, JobStatus.completed, two_segments(specs[0]))
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert page.status_code == 200
    assert 'id="segment-1"' in page.text and 'id="segment-2"' in page.text
    assert "from turn #3" in page.text
    assert html.escape(SEGMENT_REASONS["history_changed"]) in page.text
    assert 'id="generated-count">7<' in page.text  # 4 in the first segment, 3 in the second
    assert f"/ui/rollouts/{specs[0].job_id}/tokens?segment=2&amp;start=0" in page.text
    turns = app_client.get(f"/ui/rollouts/{specs[0].job_id}/turns")
    marker = turns.text.index('id="segment-start-2"')
    assert turns.text.index('id="turn-2"') < marker < turns.text.index('id="turn-3"')
    assert html.escape(SEGMENT_REASONS["history_changed"]) in turns.text


def test_viewer_shows_each_segments_own_tokens(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    _, specs = make_batch(1, 1)
    store.finish(specs[0].job_id, JobStatus.completed, two_segments(specs[0]))
    first = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens")
    assert first.text.count('class="tok gen') == 4
    assert first.text.count('class="tok obs') == 4  # 3 prompt ids and 1 observation id
    assert re.findall(r"tok gen (pv\d)", first.text) == ["pv1", "pv1", "pv2", "pv2"]
    second = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens", params={"segment": 2})
    assert second.text.count('class="tok gen') == 3
    assert second.text.count('class="tok obs') == 6  # its own prompt of 5 ids, 1 observation
    assert re.findall(r"tok gen (pv\d)", second.text) == ["pv2", "pv2", "pv3"]
    assert "turn 3" in second.text and "turn 5" in second.text
    beyond = app_client.get(f"/ui/rollouts/{specs[0].job_id}/tokens", params={"segment": 3})
    assert beyond.status_code == 404


def test_a_one_segment_trajectory_has_no_segment_markers(
    app_client: TestClient, make_batch: MakeBatch, finish: Callable[..., None]
) -> None:
    _, specs = make_batch(1, 1)
    finish(specs[0], 1.0)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    turns = app_client.get(f"/ui/rollouts/{specs[0].job_id}/turns")
    assert 'id="segment-' not in page.text and "segment-start" not in turns.text
    assert 'id="tokens"' in page.text and "tokens?start=0" in page.text


def test_viewer_shows_how_the_jobs_own_harness_ran(
    app_client: TestClient, make_batch: MakeBatch, store: Any
) -> None:
    from core.schemas import HarnessRun
    from tests.ui.conftest import trajectory_of

    _, specs = make_batch(1, 1)
    harness = HarnessRun(command="mini --task t", exit_code=3, stdout="step 1\nstep 2",
                         stderr="format error <b>", calls=2, refused_calls=1)  # fmt: skip
    traj = trajectory_of(specs[0], 0.0, harness=harness)
    store.finish(specs[0].job_id, JobStatus.completed, traj)
    page = app_client.get(f"/ui/rollouts/{specs[0].job_id}")
    assert 'id="harness"' in page.text
    assert "mini --task t" in page.text and "exit 3" in page.text
    assert "2 model calls (1 refused)" in page.text
    assert "step 1\nstep 2" in page.text and "format error &lt;b&gt;" in page.text
