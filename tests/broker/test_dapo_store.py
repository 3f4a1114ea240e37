"""Dynamic sampling in the job store against a real Redis: the finish script's group verdicts,
refills, target detection and stop confirmations, alone and under concurrent finishing."""

from __future__ import annotations

import json
import queue
import random
import threading
from collections import Counter

from broker.jobstore import DynamicOptions, FinishOutcome, JobStore, PoolTask
from core.schemas import JobStatus, StageError
from workers.dapo import attempt_samplings

PREFIX = "t:"


def pool_of(n: int) -> list[PoolTask]:
    return [
        PoolTask(
            task={"data_source": "math", "problem": f"p{i}"},
            data_source="math",
            instance_id=f"t{i}",
        )
        for i in range(n)
    ]


def create(
    store: JobStore,
    n_tasks: int,
    *,
    target: int,
    size: int = 2,
    inflight: int = 2,
    attempts: int = 1,
    early_cancel: bool = True,
    batch_id: str = "b",
) -> list[str]:
    options = DynamicOptions(target, size, inflight, attempts, early_cancel)
    samplings = attempt_samplings({"seed": 10, "max_tokens": 8}, size, attempts)
    return store.create_dynamic_batch(
        batch_id, pool_of(n_tasks), options, samplings, {"max_turns": 1, "max_total_tokens": 9}
    )


def end(
    store: JobStore, job_id: str, reward: float | None, status: JobStatus = JobStatus.completed
) -> FinishOutcome:
    """Run the job through a stage and record its end with `reward`."""
    store.transition(job_id, JobStatus.init)
    traj = store.trajectory(job_id)
    traj.reward = reward
    error = (
        None if status is JobStatus.completed else StageError(stage="run", type="x", message="x")
    )
    return store.finish_outcome(job_id, status, traj, error)


def task_index(store: JobStore, job_id: str) -> int:
    return int(store.get(job_id).instance_id[1:])


def test_first_draw_creates_groups_with_attempt_seeds_and_derived_task_ids(store: JobStore) -> None:
    jobs = create(store, 5, target=2, size=2, inflight=2, attempts=3)
    assert jobs == ["b-1-0", "b-1-1", "b-2-0", "b-2-1"]
    record = store.get("b-2-1")
    assert (record.group_id, record.sample_index, record.batch_id) == ("b-2", 1, "b")
    assert record.instance_id == "t1" and record.task == {"data_source": "math", "problem": "p1"}
    assert record.sampling == {"seed": 10, "max_tokens": 8}  # attempt 0
    assert record.task_ids == {"init": "b-2-1-init", "run": "b-2-1-run", "eval": "b-2-1-eval"}
    assert store.status_counts()["queued"] == 4
    progress = store.batch_progress("b")
    assert (progress.total, progress.groups_total, progress.done) == (4, 2, False)
    assert progress.dynamic is not None
    assert progress.dynamic.state == "running"
    assert (progress.dynamic.groups_drawn, progress.dynamic.groups_in_flight) == (2, 2)
    assert progress.dynamic.tasks_never_drawn == [2, 3, 4]
    assert store.claim_unsent("b", older_than=3600) == []
    assert len(store.claim_unsent("b", older_than=-1)) == 4
    store.mark_sent("b", jobs)
    assert store.claim_unsent("b", older_than=-1) == []


def test_verdicts_refill_and_redraw_with_fresh_seeds(store: JobStore) -> None:
    create(store, 3, target=2, size=2, inflight=1, attempts=2)
    # group 1 (task 0): uniform → filtered; task 0 goes back to the pool, task 1 is drawn
    assert end(store, "b-1-0", 1.0).new_jobs == []
    outcome = end(store, "b-1-1", 1.0)
    assert outcome.new_jobs == ["b-2-0", "b-2-1"] and outcome.event == ""
    assert task_index(store, "b-2-0") == 1
    # group 2 (task 1): mixed → accepted; task 2 is drawn next, then task 0 again
    end(store, "b-2-0", 0.0)
    assert end(store, "b-2-1", 1.0).new_jobs == ["b-3-0", "b-3-1"]
    assert task_index(store, "b-3-0") == 2
    end(store, "b-3-0", 0.0)
    outcome = end(store, "b-3-1", None, JobStatus.failed)  # failed → set aside, task 2 back
    assert outcome.new_jobs == ["b-4-0", "b-4-1"]
    redraw = store.get("b-4-1")
    assert redraw.instance_id == "t0" and redraw.sampling["seed"] == 12  # 10 + 1 attempt * 2
    progress = store.batch_progress("b").dynamic
    assert progress is not None
    assert (progress.groups_accepted, progress.groups_filtered, progress.groups_failed) == (1, 1, 1)
    assert progress.accepted_groups == ["b-2"]
    assert progress.rollouts_used == 2 and progress.rollouts_filtered == 4


def test_target_is_met_once_then_nothing_is_drawn(store: JobStore) -> None:
    create(store, 6, target=1, size=2, inflight=3)
    end(store, "b-1-0", 0.0)
    outcome = end(store, "b-1-1", 1.0)
    assert (outcome.event, outcome.new_jobs) == ("target", [])
    state = store.batch_state("b")
    assert state["state"] == "cancelling" and "t_target" in state
    assert store.stopping("b") == {"~target"}
    # another group completing now is surplus, and draws nothing
    end(store, "b-2-0", 0.0)
    late = end(store, "b-2-1", 1.0)
    assert (late.event, late.new_jobs) == ("", [])
    progress = store.batch_progress("b").dynamic
    assert progress is not None and (progress.groups_accepted, progress.groups_surplus) == (1, 1)
    assert not store.batch_progress("b").done


def test_cancelled_jobs_are_done_only_once_confirmed_stopped(store: JobStore) -> None:
    create(store, 4, target=1, size=2, inflight=2)
    store.mark_sent("b", store.batch_job_ids("b"))
    end(store, "b-1-0", 0.0)
    # b-2-0 runs a stage with a sandbox up; b-2-1 is still queued
    store.transition("b-2-0", JobStatus.init)
    store.transition("b-2-0", JobStatus.run)
    assert store.stage_begin("b-2-0", "b-2-0-run", "host|1|2")
    store.set_fields("b-2-0", sandbox={"host": "h", "keeper_pid": 1, "job_id": "b-2-0"})
    assert end(store, "b-1-1", 1.0).event == "target"
    for job_id in ("b-2-0", "b-2-1"):
        assert store.finish(job_id, JobStatus.cancelled)
    assert store.stopping("b") == {"~target", "b-2-0"}
    assert not store.cancel_end("b", "~target")  # b-2-0 still runs
    assert not store.stage_end("b-2-0", "b-2-0-other")  # another task's end changes nothing
    assert not store.stage_end("b-2-0", "b-2-0-run")  # its sandbox is still up
    assert not store.batch_done("b")
    assert not store.stage_begin("b-2-1", "b-2-1-init")  # a cancelled job's stage never starts
    assert store.sandbox_released("b-2-0")
    assert store.batch_done("b")
    progress = store.batch_progress("b")
    assert progress.done and progress.dynamic is not None
    assert progress.dynamic.state == "done" and progress.dynamic.groups_cancelled == 1
    assert progress.dynamic.rollouts_wasted == 1  # b-2-1 never started
    assert progress.dynamic.time_to_done is not None
    assert list(store.iter_finished("b", block_ms=10)) == ["b-1-0", "b-1-1"]


def test_pool_exhausted_before_the_target_ends_the_batch(store: JobStore) -> None:
    create(store, 2, target=2, size=2, inflight=2)
    for job_id in ("b-1-0", "b-1-1", "b-2-0"):
        end(store, job_id, 1.0)
    outcome = end(store, "b-2-1", 0.0)
    assert outcome.event == "done"
    progress = store.batch_progress("b")
    assert progress.done and progress.dynamic is not None
    assert not progress.dynamic.target_reached and progress.dynamic.groups_accepted == 1
    assert list(store.iter_finished("b", block_ms=10)) == ["b-2-0", "b-2-1"]


def test_without_early_cancel_the_batch_drains(store: JobStore) -> None:
    create(store, 3, target=1, size=2, inflight=2, early_cancel=False)
    end(store, "b-1-0", 0.0)
    assert end(store, "b-1-1", 1.0).event == ""
    assert store.batch_state("b")["state"] == "draining"
    end(store, "b-2-0", 0.0)
    assert end(store, "b-2-1", 1.0).event == "done"
    progress = store.batch_progress("b").dynamic
    assert progress is not None and progress.state == "done" and progress.groups_surplus == 1
    assert progress.tasks_never_drawn == [2]


def test_a_plain_batch_is_done_only_when_its_cancelled_stages_have_ended(store: JobStore) -> None:
    from tests.support.jobs import make_specs

    specs = make_specs(1, 1, batch_id="p")
    store.create_jobs(specs, batch_id="p", group_size=1)
    job_id = specs[0].job_id
    assert specs[0].task_ids["run"] == f"{job_id}-run"
    assert store.stage_begin(job_id, f"{job_id}-init", "")
    assert store.finish(job_id, JobStatus.cancelled)
    assert not store.batch_progress("p").done and not store.batch_done("p")
    store.stage_end(job_id, f"{job_id}-init")
    assert store.batch_progress("p").done and store.batch_done("p")


def test_a_new_sandbox_is_not_taken_as_released(store: JobStore) -> None:
    create(store, 2, target=1, size=2, inflight=1)
    store.sandbox_released("b-1-0")
    store.set_fields("b-1-0", sandbox={"host": "h"})
    assert store.r.hget(f"{PREFIX}job:b-1-0", "sandbox_released") is None


def test_concurrent_ends_never_overdraw_and_meet_the_target_once(store: JobStore) -> None:
    """Eight threads play workers: each takes a queued job, ends it with its task's scripted
    reward and queues the jobs its end drew. Tasks i % 3 == 0 are informative."""
    n_tasks, size, inflight, target = 60, 4, 6, 8
    first = create(store, n_tasks, target=target, size=size, inflight=inflight, attempts=2)
    work: queue.Queue[str] = queue.Queue()
    for job_id in first:
        work.put(job_id)
    events: list[str] = []
    peak = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def reward(job_id: str) -> float:
        index = task_index(store, job_id)
        sample = store.get(job_id).sample_index
        return float(sample % 2) if index % 3 == 0 else float(index % 3 == 1)

    def worker() -> None:
        try:
            while True:
                try:
                    job_id = work.get(timeout=0.5)
                except queue.Empty:
                    return
                if store.status(job_id).terminal:
                    continue
                outcome = end(store, job_id, reward(job_id))
                in_flight = int(store.batch_state("b")["groups_inflight"])
                with lock:
                    peak[0] = max(peak[0], in_flight)
                    if outcome.event:
                        events.append(outcome.event)
                for new in outcome.new_jobs:
                    work.put(new)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    random.seed(0)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert events.count("target") == 1 and "done" not in events
    assert peak[0] <= inflight
    state = store.batch_state("b")
    drawn = int(state["groups_drawn"])
    progress = store.batch_progress("b").dynamic
    assert progress is not None and progress.groups_accepted == target
    # every drawn group exists once, with its own jobs, and no task beyond its attempts
    job_ids = store.batch_job_ids("b")
    assert len(job_ids) == len(set(job_ids)) == drawn * size
    per_task = Counter(
        json.loads(store.r.hget(f"{PREFIX}group:b-{g}", "task") or "0") for g in range(1, drawn + 1)
    )
    assert max(per_task.values()) <= 2
    verdicts = Counter(
        (store.r.hget(f"{PREFIX}group:b-{g}", "verdict") or b"").decode()
        for g in range(1, drawn + 1)
    )
    assert verdicts["accepted"] == target
    assert sum(verdicts.values()) == drawn
