"""Trajectories in the job store, against a real Redis: saved turn by turn (each turn written
once), read back whole, moved to the results store at the end, and gone from Redis once
delivered. Saves follow the agent loop's own rhythm (`TrajectoryBuilder`): a model turn, a
save; its reply and the model turn's `turn_seconds`, a save."""

from __future__ import annotations

import random

import pytest
import redis

from broker.jobstore import JobStore, measure, trajectories
from broker.resultstore import DirectoryResults
from core.flatten import flatten
from core.schemas import JobStatus, Trajectory
from tests.support.jobs import make_specs
from tests.support.wait import wait_until
from workers.trajectory import TrajectoryBuilder

PROMPT = list(range(1000, 1200))


def start_job(store: JobStore, batch_id: str | None = None) -> str:
    [spec] = make_specs(1, 1, batch_id=batch_id)
    store.create_jobs([spec], batch_id=batch_id, group_size=1)
    store.transition(spec.job_id, JobStatus.run)
    return spec.job_id


def run_turns(
    store: JobStore, job_id: str, turns: int, seed: int = 0, tokens: int = 120
) -> tuple[TrajectoryBuilder, Trajectory]:
    """Save a `turns`-turn episode the way the agent loop does; returns its builder and the
    trajectory object it fills."""
    rng = random.Random(seed)
    builder = TrajectoryBuilder(PROMPT)
    trajectory = store.skeleton(store.get(job_id, task=False))
    trajectory.status = JobStatus.run
    for turn in range(turns):
        output = [rng.randrange(150_000) for _ in range(tokens)]
        model = builder.add_model_turn(
            output, [-rng.random() for _ in output], f"turn {turn}", "stop", 0.5
        )
        assert store.save_partial(job_id, builder.fill(trajectory))
        observation = [rng.randrange(150_000) for _ in range(tokens // 2)]
        builder.add_env_turn(observation, f"reply {turn}", tool_seconds=0.1)
        model.turn_seconds = 0.75
        assert store.save_partial(job_id, builder.fill(trajectory))
    return builder, trajectory


def finished_json(store: JobStore, job_id: str) -> bytes:
    return store.trajectory(job_id).model_dump_json().encode()


def test_a_partial_trajectory_reads_back_whole_with_its_flattened_record(
    store: JobStore,
) -> None:
    job_id = start_job(store)
    builder, _ = run_turns(store, job_id, 3)
    read = store.trajectory(job_id)
    assert read.turns == builder.turns
    assert read.prompt_ids == builder.prompt_ids
    assert read.response_ids == builder.response_ids
    assert read.loss_mask == builder.loss_mask
    assert read.logprobs == builder.logprobs
    assert [t.turn_seconds for t in read.turns if t.type == "model"] == [0.75] * 3


def test_no_flattened_array_is_stored_while_the_job_runs(store: JobStore) -> None:
    job_id = start_job(store)
    run_turns(store, job_id, 2)
    head = store.r.get(f"t:traj:{job_id}")
    assert head is not None
    for field in (b"response_ids", b"loss_mask", b"logprobs", b"prompt_ids", b"turns"):
        assert field not in head
    assert store.r.llen(f"t:turns:{job_id}") == 4


def test_each_turn_is_written_once_so_writes_stay_within_twice_the_final_size(
    store: JobStore,
) -> None:
    job_id = start_job(store)
    sent_before = store.r.info("stats")["total_net_input_bytes"]
    _, trajectory = run_turns(store, job_id, 30)
    trajectory.reward = 1.0
    assert store.finish(job_id, JobStatus.completed, trajectory)
    sent = store.r.info("stats")["total_net_input_bytes"] - sent_before
    final = finished_json(store, job_id)
    written = store.written_bytes(job_id)
    assert 0 < written <= 2 * len(final)
    # what crossed the wire to Redis (every command of the saves and the end) too
    assert written < sent <= 2 * len(final)
    # rewriting the whole trajectory at every save would have written this much
    rewrites = sum(
        len(trajectory.model_copy(update={"turns": trajectory.turns[:n]}).model_dump_json())
        for n in range(1, len(trajectory.turns) + 1)
    )
    assert written * 10 < rewrites


def test_writes_grow_linearly_with_the_number_of_turns(store: JobStore) -> None:
    short, long = start_job(store), start_job(store)
    run_turns(store, short, 10)
    run_turns(store, long, 40)
    # four times the turns: about four times the bytes (a rewrite per save would be ~16x)
    assert store.written_bytes(long) < 5 * store.written_bytes(short)


def test_a_model_turn_timed_after_its_save_reads_back_with_its_time(store: JobStore) -> None:
    job_id = start_job(store)
    builder = TrajectoryBuilder(PROMPT)
    trajectory = store.skeleton(store.get(job_id, task=False))
    model = builder.add_model_turn([1, 2], [-0.1, -0.2], "a", "stop", 0.1)
    store.save_partial(job_id, builder.fill(trajectory))
    builder.add_env_turn([3], "b")
    model.turn_seconds = 2.5
    store.save_partial(job_id, builder.fill(trajectory))
    read = store.trajectory(job_id)
    assert [t.type for t in read.turns] == ["model", "env"]
    assert read.turns[0].turn_seconds == 2.5  # type: ignore[union-attr]


def test_a_turn_changed_after_its_save_is_replaced(store: JobStore) -> None:
    job_id = start_job(store)
    builder = TrajectoryBuilder(PROMPT)
    trajectory = store.skeleton(store.get(job_id, task=False))
    builder.add_model_turn([1, 2], [-0.1, -0.2], "a", "stop", 0.1)
    store.save_partial(job_id, builder.fill(trajectory))
    builder.turns[-1] = builder.turns[-1].model_copy(update={"text": "b"})
    store.save_partial(job_id, builder.fill(trajectory))
    assert [t.text for t in store.trajectory(job_id).turns] == ["b"]
    assert store.r.llen(f"t:turns:{job_id}") == 1


def test_an_episode_that_starts_over_replaces_the_stored_turns(store: JobStore) -> None:
    job_id = start_job(store)
    run_turns(store, job_id, 4, seed=1)
    again, _ = run_turns(store, job_id, 1, seed=2)
    read = store.trajectory(job_id)
    assert read.turns == again.turns
    assert read.response_ids == again.response_ids


@pytest.mark.parametrize("same_start", [True, False])
def test_a_store_in_another_process_brings_the_stored_turns_level(
    store: JobStore, redis_url: str, results: DirectoryResults, same_start: bool
) -> None:
    """A second worker process (no memory of what the first wrote) saves the same episode
    further on, or one that started over with as many turns."""
    job_id = start_job(store)
    run_turns(store, job_id, 3, seed=1)
    other = JobStore(redis.Redis.from_url(redis_url), prefix="t:", results=results)
    builder, _ = run_turns(other, job_id, 4 if same_start else 3, seed=1 if same_start else 9)
    read = store.trajectory(job_id)
    assert read.turns == builder.turns
    assert read.response_ids == builder.response_ids


def test_the_store_derives_the_flattened_record_as_the_builder_keeps_it() -> None:
    builder = TrajectoryBuilder([7, 8, 9])
    builder.add_model_turn([1, 2], [-0.5, -0.25], "x", "stop", 0.1)
    builder.add_env_turn([3, 4, 5], "y")
    builder.add_model_turn([6], [-1.0], "z", "stop", 0.1)
    flat = flatten(builder.turns)
    assert flat.prompt_ids == builder.prompt_ids
    assert flat.response_ids == builder.response_ids
    assert flat.loss_mask == builder.loss_mask
    assert flat.logprobs == builder.logprobs


def test_a_finished_trajectory_moves_to_the_results_store(
    store: JobStore, results: DirectoryResults
) -> None:
    job_id = start_job(store, batch_id="b1")
    builder, trajectory = run_turns(store, job_id, 3)
    trajectory.reward = 0.5
    assert store.finish(job_id, JobStatus.completed, trajectory)
    for key in (f"t:traj:{job_id}", f"t:turns:{job_id}", f"t:sums:{job_id}"):
        assert not store.r.exists(key)
    record = store.get(job_id)
    assert record.result is not None
    line = results.read(record.result)
    assert line is not None
    kept = Trajectory.model_validate_json(line)
    assert (kept.status, kept.reward, kept.turns) == (JobStatus.completed, 0.5, builder.turns)
    assert kept.response_ids == builder.response_ids  # flattened once, for the results
    read = store.trajectory(job_id)
    assert read.reward == 0.5
    assert read.loss_mask == builder.loss_mask


def test_a_delivered_job_leaves_almost_nothing_in_redis(
    redis_url: str, results: DirectoryResults
) -> None:
    store = JobStore(redis.Redis.from_url(redis_url), prefix="t:", results=results, stub_ttl=1)
    job_id = start_job(store, batch_id="b1")
    _, trajectory = run_turns(store, job_id, 20)
    running = store.stored_bytes(job_id)
    trajectory.reward = 1.0
    assert store.finish(job_id, JobStatus.completed, trajectory)
    final = finished_json(store, job_id)
    stub = store.stored_bytes(job_id)
    assert stub * 20 < len(final)
    assert stub * 20 < running
    store.delivered(job_id)
    assert 0 < store.r.ttl(f"t:job:{job_id}") <= 1
    wait_until(lambda: store.stored_bytes(job_id) == 0, 30, "the stub to expire")
    # still readable, from the results store alone
    assert store.trajectory(job_id).model_dump_json().encode() == final


def test_a_job_delivered_while_it_runs_keeps_its_record(store: JobStore) -> None:
    job_id = start_job(store)
    run_turns(store, job_id, 1)
    store.delivered(job_id)
    assert store.r.ttl(f"t:job:{job_id}") > 60


class FailingOnce(DirectoryResults):
    """A results store whose first write fails (a full disk, a bucket down)."""

    failed = False

    def put(self, job_id: str, batch_id: str | None, line: bytes, now: float) -> str:
        if not self.failed:
            self.failed = True
            raise OSError("no space left on device")
        return super().put(job_id, batch_id, line, now)


def test_a_trajectory_the_results_store_refused_stays_in_redis_until_a_read_moves_it(
    redis_url: str, results: DirectoryResults, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = FailingOnce(results.root, results.keep)
    store = JobStore(redis.Redis.from_url(redis_url), prefix="t:", results=flaky, stub_ttl=60)
    job_id = start_job(store)
    builder, trajectory = run_turns(store, job_id, 2)
    assert store.finish(job_id, JobStatus.completed, trajectory)
    assert store.get(job_id).result is None
    assert store.trajectory(job_id).turns == builder.turns  # read from Redis meanwhile
    store.delivered(job_id)
    assert store.r.ttl(f"t:job:{job_id}") > 60  # not before it is safe elsewhere
    monkeypatch.setattr(trajectories, "OFFLOAD_GRACE", 0.0)
    assert store.trajectory(job_id).turns == builder.turns  # this read moves it
    assert store.get(job_id).result is not None
    assert not store.r.exists(f"t:turns:{job_id}")
    assert 0 < store.r.ttl(f"t:job:{job_id}") <= 60


def test_the_measurements_report_bytes_per_token_and_memory_after_delivery(
    store: JobStore,
) -> None:
    job_id = start_job(store, batch_id="b1")
    _, trajectory = run_turns(store, job_id, 10)
    tokens = len(trajectory.prompt_ids) + len(trajectory.response_ids)
    assert measure.bytes_written_per_token(store, job_id) == store.written_bytes(job_id) / tokens
    before_end = store.stored_bytes(job_id)
    assert store.finish(job_id, JobStatus.completed, trajectory)
    after = measure.memory_after_delivery(store, job_id)
    assert 0 < after == store.stored_bytes(job_id) < before_end / 20
    assert 0 < store.r.ttl(f"t:job:{job_id}") <= store.stub_ttl


def test_a_delivered_job_keeps_its_record_while_it_still_holds_a_stage_or_a_sandbox(
    store: JobStore,
) -> None:
    job_id = start_job(store)
    store.set_fields(job_id, sandbox={"host": "node-a"})
    assert store.stage_begin(job_id, f"{job_id}-eval")
    _, trajectory = run_turns(store, job_id, 1)
    assert store.finish(job_id, JobStatus.cancelled, trajectory)
    store.delivered(job_id)  # read at once, while the stage is still winding down
    assert store.r.ttl(f"t:job:{job_id}") > store.stub_ttl
    store.stage_end(job_id, f"{job_id}-eval")
    assert store.r.ttl(f"t:job:{job_id}") > store.stub_ttl  # its box is still up
    store.sandbox_released(job_id)
    assert 0 < store.r.ttl(f"t:job:{job_id}") <= store.stub_ttl


def test_a_read_racing_the_move_to_the_results_store_still_gets_the_trajectory(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end is recorded first, the move to the results store follows: a reader that saw
    the ended record before the move, and looks for the turns after it, reads the record
    again and finds the trajectory where it went."""
    job_id = start_job(store)
    _, trajectory = run_turns(store, job_id, 2)
    trajectory.reward = 1.0
    moves: list[tuple[str, Trajectory, float]] = []
    monkeypatch.setattr(store, "offload", lambda *args: moves.append(args))  # held back
    assert store.finish(job_id, JobStatus.completed, trajectory)
    monkeypatch.undo()
    [(_, final, at)] = moves
    real = store.stored_trajectory

    def moved_meanwhile(job: str) -> Trajectory | None:
        store.offload(job, final, at)  # the finishing worker's move lands between the reads
        monkeypatch.setattr(store, "stored_trajectory", real)
        return real(job)

    monkeypatch.setattr(store, "stored_trajectory", moved_meanwhile)
    read = store.trajectory(job_id)
    assert store.get(job_id, task=False).result is not None  # it did move
    assert read.status is JobStatus.completed and read.reward == 1.0
    assert read.response_ids == trajectory.response_ids and len(read.turns) == 4
