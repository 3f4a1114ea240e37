"""The dispatcher against a real Redis and a real Celery app (no workers): a recorded end
sends the groups it drew, the target's end cancels the rest once, and `recover` finishes what
a worker that died mid-follow-up left behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from broker.celery_app import create_celery
from broker.jobstore import DynamicOptions, JobStore, PoolTask
from core.schemas import JobStatus
from core.settings import Settings
from routing.pool import BackendPool
from workers.dapo import attempt_samplings
from workers.dispatch import TARGET_TOKEN, Dispatcher


@pytest.fixture
def dispatcher(redis_url: str) -> Iterator[Dispatcher]:
    client = redis.Redis.from_url(redis_url)
    app = create_celery(Settings(redis_url=redis_url), redis_url)
    yield Dispatcher(JobStore(client), BackendPool(client), app, "node-a")
    app.close()
    client.close()


def create(store: JobStore, n: int, target: int, inflight: int) -> list[str]:
    pool = [PoolTask({"data_source": "math", "problem": str(i)}, "math", f"t{i}") for i in range(n)]
    options = DynamicOptions(target, 2, inflight, 1)
    return store.create_dynamic_batch(
        "b", pool, options, attempt_samplings({"seed": 0}, 2, 1), {"max_turns": 1}
    )


def complete(dispatcher: Dispatcher, job_id: str, reward: float, *, follow: bool = True) -> None:
    store = dispatcher.store
    store.transition(job_id, JobStatus.init)
    traj = store.trajectory(job_id)
    traj.reward = reward
    if follow:
        dispatcher.finish(job_id, JobStatus.completed, traj)
    else:
        store.finish_outcome(job_id, JobStatus.completed, traj)


def test_an_end_that_draws_sends_the_new_groups(
    dispatcher: Dispatcher, redis_client: redis.Redis
) -> None:
    store = dispatcher.store
    dispatcher.send_drawn("b", create(store, 4, target=2, inflight=1))
    assert redis_client.llen("init") == 2
    complete(dispatcher, "b-1-0", 1.0)
    complete(dispatcher, "b-1-1", 1.0)  # filtered: the next group is drawn and sent at once
    assert redis_client.llen("init") == 4
    assert store.claim_unsent("b", older_than=-1) == []


def test_the_targets_end_cancels_the_rest_once(
    dispatcher: Dispatcher, redis_client: redis.Redis
) -> None:
    store = dispatcher.store
    dispatcher.send_drawn("b", create(store, 6, target=1, inflight=3))
    complete(dispatcher, "b-1-0", 0.0)
    complete(dispatcher, "b-1-1", 1.0)
    progress = store.batch_progress("b")
    assert progress.done and progress.dynamic is not None
    assert progress.counts == {"cancelled": 4, "completed": 2, "pending": 0}
    assert progress.dynamic.groups_cancelled == 2
    record = store.get("b-2-0")
    assert record.error is not None and "target of 1" in record.error.message
    assert list(store.iter_finished("b", block_ms=10)) == ["b-1-0", "b-1-1"]


def test_two_cancellation_passes_at_once_end_the_batch_once(dispatcher: Dispatcher) -> None:
    store = dispatcher.store
    dispatcher.send_drawn("b", create(store, 8, target=2, inflight=4))
    passes = [threading.Thread(target=dispatcher.cancel_batch, args=("b",)) for _ in range(4)]
    for t in passes:
        t.start()
    for t in passes:
        t.join()
    progress = store.batch_progress("b")
    assert progress.done and progress.counts == {"cancelled": 8, "pending": 0}
    entries = store.r.xrange("rs:batch:b:accepted")
    assert len(entries) == 1  # one end marker


def test_recover_sends_what_a_dead_worker_drew_and_finishes_its_cancellation(
    dispatcher: Dispatcher, redis_client: redis.Redis
) -> None:
    store = dispatcher.store
    first = create(store, 6, target=1, inflight=2)  # the sender "died": nothing sent
    dispatcher.recover("b", older_than=3600)
    assert redis_client.llen("init") == 0  # still within the grace period
    dispatcher.recover("b", older_than=-1)
    assert redis_client.llen("init") == len(first)
    # the target is met but the worker dies before cancelling the rest
    complete(dispatcher, "b-1-0", 0.0, follow=False)
    complete(dispatcher, "b-1-1", 1.0, follow=False)
    assert TARGET_TOKEN in store.stopping("b") and not store.batch_progress("b").done
    dispatcher.recover("b", older_than=-1)
    progress = store.batch_progress("b")
    assert progress.done and progress.counts == {"cancelled": 2, "completed": 2, "pending": 0}


def test_recover_takes_a_stop_nobody_can_confirm_after_the_hard_limit(
    dispatcher: Dispatcher,
) -> None:
    store = dispatcher.store
    dispatcher.send_drawn("b", create(store, 3, target=1, inflight=1))
    store.transition("b-1-0", JobStatus.init)
    assert store.stage_begin("b-1-0", "b-1-0-init", "gone-node|1|1")  # its worker then died
    dispatcher.cancel_batch("b")
    assert store.stopping("b") == {"b-1-0"} and not store.batch_progress("b").done
    dispatcher.recover("b", stuck_after=3600)
    assert not store.batch_progress("b").done
    dispatcher.recover("b", stuck_after=-1)
    assert store.batch_progress("b").done


def test_a_running_stage_gets_the_grace_to_stop_before_it_is_terminated(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = dispatcher.store
    dispatcher.send_drawn("b", create(store, 4, target=1, inflight=2))
    for job_id in ("b-1-0", "b-2-0"):
        store.transition(job_id, JobStatus.init)
        assert store.stage_begin(job_id, f"{job_id}-init", "node-a|1|1")
    revokes: list[tuple[list[str], bool]] = []
    real = dispatcher.celery.control.revoke

    def record(task_ids: list[str], terminate: bool = False, **kwargs: object) -> object:
        revokes.append((list(task_ids), terminate))
        return real(task_ids, terminate=terminate, **kwargs)

    monkeypatch.setattr(dispatcher.celery.control, "revoke", record)
    # b-1-0's stage notices the cancel and ends during the grace; b-2-0's does not
    threading.Timer(0.2, lambda: store.stage_end("b-1-0", "b-1-0-init")).start()
    dispatcher.cancel_batch("b")
    queued, killed = revokes
    assert not queued[1] and "b-1-0-init" not in queued[0] and "b-1-0-run" in queued[0]
    assert killed == (["b-2-0-init"], True)
    assert store.stopping("b") == {"b-2-0"}  # until its worker confirms the kill
