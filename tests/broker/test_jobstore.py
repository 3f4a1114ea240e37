"""The job store against a real Redis: transitions, exactly-once finish, counters, streams."""

from __future__ import annotations

import threading
import time

import pytest

from broker.jobstore import JobNotFound, JobStore, records
from core.schemas import JobStatus, StageError, Trajectory
from tests.support.jobs import make_specs


def with_reward(store: JobStore, job_id: str, reward: float) -> Trajectory:
    traj = store.trajectory(job_id)
    traj.reward = reward
    return traj


def test_created_jobs_are_queued_and_counted(store: JobStore) -> None:
    specs = make_specs(2, 2)
    store.create_jobs(specs, batch_id="b1", group_size=2)
    assert all(store.status(s.job_id) is JobStatus.queued for s in specs)
    assert store.status_counts()["queued"] == 4
    progress = store.batch_progress("b1")
    assert (progress.total, progress.groups_total, progress.finished, progress.done) == (
        4,
        2,
        0,
        False,
    )


def test_live_names_the_jobs_that_have_not_ended(store: JobStore) -> None:
    specs = make_specs(1, 3)
    store.create_jobs(specs, batch_id="b1", group_size=3)
    ids = [s.job_id for s in specs]
    store.transition(ids[1], JobStatus.run)
    store.finish(ids[2], JobStatus.cancelled)
    assert store.live([*ids, "missing"]) == {ids[0], ids[1]}
    assert store.live([]) == set()


def test_every_end_is_announced_once_on_the_ended_channel(store: JobStore) -> None:
    specs = make_specs(1, 3)
    store.create_jobs(specs, batch_id="b1", group_size=3)
    ids = [s.job_id for s in specs]
    heard: list[str] = []
    stop = threading.Event()
    listener = threading.Thread(target=store.listen_ended, args=(heard.append, stop))
    listener.start()
    try:
        # Subscribed once Redis counts a subscriber on the channel.
        deadline = time.monotonic() + 10
        while store.r.pubsub_numsub(store.ended_channel)[0][1] < 1:
            assert time.monotonic() < deadline, "the listener never subscribed"
            time.sleep(0.01)
        store.transition(ids[0], JobStatus.run)  # not an end: not announced
        store.finish(ids[1], JobStatus.cancelled)
        store.finish(ids[1], JobStatus.completed)  # refused: already ended, not announced
        store.finish(ids[2], JobStatus.failed)
        deadline = time.monotonic() + 10
        while len(heard) < 2:
            assert time.monotonic() < deadline, f"heard only {heard}"
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        stop.set()
        listener.join(timeout=5)
    assert not listener.is_alive()
    assert heard == [ids[1], ids[2]]


def test_live_reads_many_jobs_in_chunks(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "LIVE_CHUNK", 2)
    specs = make_specs(1, 5)
    store.create_jobs(specs, batch_id="b1", group_size=5)
    ids = [s.job_id for s in specs]
    for ended in (ids[1], ids[4]):
        store.finish(ended, JobStatus.failed)
    asked = [ids[0], "gone", *ids[1:], ids[0]]
    assert store.live(asked) == {ids[0], ids[2], ids[3]}


def test_transition_records_first_entry_time_and_moves_counts(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    assert store.transition(spec.job_id, JobStatus.init)
    first = store.get(spec.job_id).times["init"]
    assert not store.transition(spec.job_id, JobStatus.init)  # already there
    assert store.get(spec.job_id).times["init"] == first
    counts = store.status_counts()
    assert (counts["queued"], counts["init"]) == (0, 1)


def test_finish_is_recorded_exactly_once(store: JobStore) -> None:
    specs = make_specs(1, 2)
    store.create_jobs(specs, batch_id="b1", group_size=2)
    job = specs[0].job_id
    store.transition(job, JobStatus.run)
    assert store.finish(job, JobStatus.completed, with_reward(store, job, 1.0))
    assert not store.finish(job, JobStatus.completed, with_reward(store, job, 0.0))
    assert not store.finish(job, JobStatus.cancelled)
    progress = store.batch_progress("b1")
    assert progress.finished == 1
    assert progress.counts["completed"] == 1
    assert progress.mean_reward == 1.0
    assert store.trajectory(job).reward == 1.0
    assert store.status_counts()["completed"] == 1
    assert store.status_counts()["run"] == 0
    assert store.r.xlen("t:batch:b1:done") == 1
    # the stream of ends lives as long as its batch, and the ended job waits for no stage
    assert 0 < store.r.ttl("t:batch:b1:done") <= store.r.ttl("t:batch:b1")
    assert store.r.zscore(store.transit_key, job) is None
    assert store.r.zscore(store.transit_key, specs[1].job_id) is not None


def test_no_transition_or_partial_save_after_the_end(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    error = StageError(stage="queued", type="cancelled", message="cancelled by request")
    assert store.finish(spec.job_id, JobStatus.cancelled, error=error)
    assert not store.transition(spec.job_id, JobStatus.run)
    late = store.trajectory(spec.job_id)
    late.response_ids = [1, 2, 3]
    assert not store.save_partial(spec.job_id, late)
    final = store.trajectory(spec.job_id)
    assert final.status is JobStatus.cancelled
    assert final.response_ids == []
    assert final.error == error


def test_finish_without_trajectory_keeps_the_partial_one(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    partial = store.trajectory(spec.job_id)
    partial.response_ids = [5, 6]
    partial.loss_mask = [1, 1]
    partial.logprobs = [-0.1, -0.2]
    assert store.save_partial(spec.job_id, partial)
    store.finish(
        spec.job_id, JobStatus.timed_out, error=StageError(stage="run", type="timeout", message="x")
    )
    final = store.trajectory(spec.job_id)
    assert final.status is JobStatus.timed_out
    assert final.response_ids == [5, 6]


def test_group_counts_as_finished_when_all_its_samples_are(store: JobStore) -> None:
    specs = make_specs(2, 2)
    store.create_jobs(specs, batch_id="b1", group_size=2)
    for spec in specs[:3]:
        store.finish(spec.job_id, JobStatus.completed, with_reward(store, spec.job_id, 0.5))
    assert store.batch_progress("b1").groups_finished == 1
    store.finish(
        specs[3].job_id, JobStatus.failed, error=StageError(stage="run", type="X", message="y")
    )
    progress = store.batch_progress("b1")
    assert (progress.groups_finished, progress.done) == (2, True)
    assert progress.counts == {"completed": 3, "failed": 1, "pending": 0}


def test_finished_jobs_stream_in_finishing_order(store: JobStore) -> None:
    specs = make_specs(3, 1)
    store.create_jobs(specs, batch_id="b1", group_size=1)
    order = [specs[2].job_id, specs[0].job_id, specs[1].job_id]

    def finish_later() -> None:
        for job in order:
            time.sleep(0.05)
            store.finish(job, JobStatus.completed, with_reward(store, job, 1.0))

    thread = threading.Thread(target=finish_later)
    thread.start()
    seen = [j for j in store.iter_finished("b1", block_ms=100) if j is not None]
    thread.join()
    assert seen == order


def test_wait_wakes_when_the_job_finishes(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    timer = threading.Timer(
        0.2,
        lambda: store.finish(spec.job_id, JobStatus.completed, with_reward(store, spec.job_id, 1)),
    )
    timer.start()
    assert store.wait(spec.job_id, timeout=30) is JobStatus.completed
    # A second waiter on the finished job does not block either.
    assert store.wait(spec.job_id, timeout=30) is JobStatus.completed
    timer.join()


def test_wait_returns_the_live_status_on_timeout(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    assert store.wait(spec.job_id, timeout=0.2) is JobStatus.queued


def test_delete_jobs_leaves_no_trace(store: JobStore) -> None:
    specs = make_specs(2, 2)
    store.create_jobs(specs, batch_id="b1", group_size=2)
    store.delete_jobs(specs, "b1")
    assert [k for k in store.r.keys("t:*") if k != b"t:counts"] == []
    assert store.status_counts()["queued"] == 0
    with pytest.raises(JobNotFound):
        store.get(specs[0].job_id)


def test_stage_histogram_is_cumulative(store: JobStore) -> None:
    [spec] = make_specs(1, 1, batch_id=None)
    store.create_jobs([spec])
    store.stage_finished(spec.job_id, "run", 0.02)
    store.stage_finished(spec.job_id, "run", 3.0)
    buckets, count, total = store.stage_histogram("run")
    as_dict = dict(buckets)
    assert (as_dict[0.01], as_dict[0.025], as_dict[5.0], count) == (0, 1, 2, 2)
    assert total == pytest.approx(3.02)
    assert store.get(spec.job_id).durations["run"] == pytest.approx(3.02)
