"""bench/pipeline.py splits a job's overhead into parts that add up to it."""

from __future__ import annotations

import pytest

from bench.pipeline import PARTS, overhead_parts
from core.schemas import JobStatus, Timing, Trajectory


def trajectory(created: float, finished: float, timing: Timing) -> Trajectory:
    return Trajectory(
        job_id="j",
        group_id="g",
        instance_id="i",
        data_source="math",
        status=JobStatus.completed,
        created_at=created,
        finished_at=finished,
        timing=timing,
    )


def test_the_parts_add_up_to_the_overhead() -> None:
    # The client started at 100.0 and had the result 0.2 s later; the job's record says it
    # was created at 100.01, ended at 100.19, with 0.03 s between stages.
    timing = Timing(queue=0.03, init=0.02, run=0.1, eval=0.03, llm=0.06)
    parts = overhead_parts(100.0, 0.2, trajectory(100.01, 100.19, timing))
    assert list(parts) == list(PARTS)
    assert parts["submit"] == pytest.approx(0.01)
    assert parts["hops"] == pytest.approx(0.03)
    assert parts["run_without_model"] == pytest.approx(0.04)
    assert parts["delivery"] == pytest.approx(0.01)
    assert sum(parts.values()) == pytest.approx(0.2 - timing.llm)


def test_a_job_without_stage_times_counts_them_as_zero() -> None:
    parts = overhead_parts(5.0, 1.0, trajectory(5.5, 5.9, Timing()))
    assert parts["init"] == parts["eval"] == parts["hops"] == 0.0
    assert parts["submit"] == pytest.approx(0.5)
    assert parts["delivery"] == pytest.approx(0.1)
