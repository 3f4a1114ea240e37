"""The sweeper against a real Redis and a real Celery app (no workers): stages of dead workers
taken over exactly once, stale redeliveries dropped, stages past their hard limit or their
job's time budget timed out, jobs of a dead node restarted from INIT."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from broker.celery_app import create_celery
from broker.jobstore import JobSpec, JobStore
from core.schemas import JobStatus
from core.settings import Settings
from routing.pool import BackendPool
from workers import lifecycle, liveness, stages
from workers.process_state import Runtime
from workers.sweeper import Action, sweep

DEAD = "node-a|999999|1"
"""The owner id of a worker that has stopped (nothing writes its heartbeat)."""
LIVE = "node-a|424242|1"


@pytest.fixture
def rt(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(
        redis_url=redis_url, node_name="node-a", heartbeat_interval=1, heartbeat_ttl=3
    )
    app = create_celery(settings, redis_url)
    runtime = Runtime(
        settings=settings, store=JobStore(client), pool=BackendPool(client), celery=app
    )
    monkeypatch.setattr(lifecycle, "get_runtime", lambda: runtime)
    # the sweeping process is a live worker: the stages it takes over stay its own
    runtime.store.beat(liveness.owner(runtime), "node-a", [], ttl=60)
    yield runtime
    app.close()
    client.close()


def make_job(store: JobStore, agent: dict[str, Any] | None = None) -> str:
    spec = JobSpec(
        task={"data_source": "math", "problem": "1+1"},
        data_source="math",
        instance_id="t",
        sampling={},
        agent=agent or {},
        group_id="g",
        batch_id="b",
    )
    store.create_jobs([spec], batch_id="b", group_size=1)
    return spec.job_id


def running(store: JobStore, stage: str, holder: str, agent: dict[str, Any] | None = None) -> str:
    """A job whose `stage` is held by `holder` (INIT done before a RUN or EVAL)."""
    job_id = make_job(store, agent)
    if stage != "init":
        store.transition(job_id, JobStatus.init)
        store.stage_finished(job_id, "init", 0.5)
    store.transition(job_id, JobStatus(stage))
    assert store.begin_stage(job_id, f"{job_id}-{stage}", holder, holder, 0) == "began"
    return job_id


def queued(r: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The stage messages waiting in `queue`: task id, args and the rest of the chain."""
    out = []
    for raw in r.lrange(queue, 0, -1):
        message = json.loads(raw)
        args, _kwargs, embed = json.loads(base64.b64decode(message["body"]))
        chain = [link["task"] for link in reversed(embed.get("chain") or [])]
        out.append({"id": message["headers"]["id"], "args": args, "chain": chain})
    return out


def fake_task(task_id: str) -> Any:
    return SimpleNamespace(request=SimpleNamespace(id=task_id, chain=["next"]))


def later(rt: Runtime, seconds: float = 0.0) -> float:
    """A sweep time past the heartbeat's time to live (and `seconds` more)."""
    return time.time() + rt.settings.heartbeat_ttl + 1 + seconds


def test_a_dead_workers_stage_is_sent_again_exactly_once_by_racing_sweepers(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = running(rt.store, "run", DEAD)
    now = later(rt)
    barrier = threading.Barrier(8)
    results: list[list[Action]] = []

    def one() -> None:
        barrier.wait()
        results.append(sweep(rt, now))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    actions = [a for found in results for a in found]
    assert [(a.job_id, a.what, a.stage, a.attempt) for a in actions] == [
        (job_id, "requeued", "run", 1)
    ]
    assert queued(redis_client, "run") == [
        {"id": f"{job_id}-run", "args": [job_id, 1], "chain": ["rollserve.eval"]}
    ]
    assert redis_client.llen("init") == 0
    record = redis_client.hgetall(f"rs:job:{job_id}")
    assert (record["attempt"], record["active"], record["active_pending"]) == (
        "1",
        f"{job_id}-run",
        "1",
    )
    assert record["status"] == "run"


def test_the_lost_attempts_message_is_dropped_and_the_new_one_runs(rt: Runtime) -> None:
    job_id = running(rt.store, "run", DEAD)
    [action] = sweep(rt, later(rt))
    assert action.attempt == 1
    ran: list[str] = []
    stale = fake_task(f"{job_id}-run")
    lifecycle.tracked(stale, job_id, lambda: ran.append("stale"), attempt=0)
    assert ran == [] and stale.request.chain is None
    assert rt.store.holdings([job_id])[job_id].pending  # untouched by the stale message
    fresh = fake_task(f"{job_id}-run")
    lifecycle.tracked(fresh, job_id, lambda: ran.append("fresh"), attempt=1)
    assert ran == ["fresh"] and fresh.request.chain == ["next"]
    assert rt.store.active_stage(job_id) is None


def test_a_stage_whose_worker_beats_is_left_alone(rt: Runtime) -> None:
    rt.store.beat(LIVE, "node-a", ["run"], ttl=60)
    job_id = running(rt.store, "run", LIVE)
    assert sweep(rt, later(rt)) == []
    assert rt.store.holdings([job_id])[job_id].attempt == 0


def test_a_freshly_begun_stage_is_not_taken_before_the_heartbeat_ttl(rt: Runtime) -> None:
    running(rt.store, "run", DEAD)
    assert sweep(rt, time.time()) == []


def test_past_the_last_attempt_the_job_fails(rt: Runtime, redis_client: redis.Redis) -> None:
    rt.settings.max_attempts = 2
    job_id = running(rt.store, "init", DEAD)
    [first] = sweep(rt, later(rt))
    assert (first.what, first.attempt) == ("requeued", 1)
    # the second attempt begins on a worker that dies too
    assert rt.store.begin_stage(job_id, f"{job_id}-init", DEAD, DEAD, 1) == "began"
    [second] = sweep(rt, later(rt))
    assert (second.what, second.stage) == ("failed", "init")
    traj = rt.store.trajectory(job_id)
    assert traj.status is JobStatus.failed and traj.error is not None
    assert traj.error.type == "worker_lost" and "2 attempts" in traj.error.message
    assert rt.store.active_stage(job_id) is None and rt.store.held() == []
    assert len(queued(redis_client, "init")) == 1  # only the second attempt was ever sent


def test_a_stage_past_its_hard_limit_ends_timed_out(rt: Runtime) -> None:
    rt.store.beat(LIVE, "node-a", ["eval"], ttl=60)
    job_id = running(rt.store, "eval", LIVE)
    assert sweep(rt, time.time() + 1) == []
    assert sweep(rt, time.time() + rt.settings.eval_time_limit + 1) == []
    [action] = sweep(rt, time.time() + rt.settings.eval_time_limit + rt.settings.heartbeat_ttl + 1)
    assert (action.what, action.stage) == ("timed_out", "eval")
    traj = rt.store.trajectory(job_id)
    assert traj.status is JobStatus.timed_out and traj.error is not None
    assert (traj.error.stage, traj.error.type) == ("eval", "timeout")
    assert "hard limit" in traj.error.message
    assert rt.store.active_stage(job_id) is None and rt.store.held() == []


def test_a_stage_past_the_jobs_time_budget_ends_timed_out(rt: Runtime) -> None:
    rt.store.beat(LIVE, "node-a", ["run"], ttl=60)
    job_id = running(rt.store, "run", LIVE, agent={"max_seconds": 5})
    assert sweep(rt, time.time() + 2) == []
    grace = rt.settings.heartbeat_ttl + rt.settings.sweep_interval
    [action] = sweep(rt, time.time() + 5 + grace + 1)
    assert (action.what, action.stage) == ("timed_out", "run")
    traj = rt.store.trajectory(job_id)
    assert traj.error is not None and "agent.max_seconds" in traj.error.message


def test_a_stage_does_not_begin_once_the_budget_is_spent(rt: Runtime) -> None:
    job_id = make_job(rt.store, agent={"max_seconds": 1})
    rt.store.transition(job_id, JobStatus.init)
    rt.store.stage_finished(job_id, "init", 1.5)
    with pytest.raises(stages.TimeBudgetSpent, match="spent before its run stage"):
        stages.run_stage(rt, job_id)
    assert rt.store.status(job_id) is JobStatus.init


def test_a_pinned_job_of_a_lost_node_starts_again_from_init(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = make_job(rt.store)
    rt.store.transition(job_id, JobStatus.init)
    rt.store.set_fields(job_id, sandbox={"host": "node-b", "socket_path": "/nowhere"})
    rt.store.pin(job_id, "node-b")
    rt.store.stage_finished(job_id, "init", 0.5)  # waiting in run.node-b
    rt.store.beat("node-b|1|1", "node-b", ["init", "run", "eval"], ttl=60)
    assert sweep(rt, later(rt)) == []  # its node is alive
    redis_client.delete(rt.store.node_beat_key("node-b", "run"))  # no run worker there now
    [action] = sweep(rt, later(rt))
    assert (action.what, action.stage, action.attempt) == ("restarted", "init", 1)
    assert queued(redis_client, "init") == [
        {"id": f"{job_id}-init", "args": [job_id, 1], "chain": ["rollserve.run", "rollserve.eval"]}
    ]
    record = rt.store.get(job_id)
    assert record.sandbox is None and record.context is None
    assert rt.store.pinned("node-b") == []
    assert sweep(rt, later(rt)) == []  # taken over once; pending on this sweeper


def test_a_dead_workers_run_of_a_lost_node_restarts_and_of_a_live_one_stays_pinned(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    lost = running(rt.store, "run", DEAD)
    kept = running(rt.store, "run", DEAD)
    for job_id, node in ((lost, "node-b"), (kept, "node-c")):
        rt.store.set_fields(job_id, sandbox={"host": node, "socket_path": "/nowhere"})
        rt.store.pin(job_id, node)
    rt.store.beat("node-c|1|1", "node-c", ["run"], ttl=60)
    done = {a.job_id: a.what for a in sweep(rt, later(rt))}
    assert done == {lost: "restarted", kept: "requeued"}
    assert [m["id"] for m in queued(redis_client, "init")] == [f"{lost}-init"]
    assert [m["id"] for m in queued(redis_client, "run.node-c")] == [f"{kept}-run"]


def test_an_ended_job_marked_by_a_dead_worker_is_released(rt: Runtime) -> None:
    job_id = running(rt.store, "run", DEAD)
    rt.dispatcher.cancel_jobs([job_id])
    assert rt.store.stopping("b") == {job_id}
    [action] = sweep(rt, later(rt))
    assert action.what == "released"
    assert rt.store.stopping("b") == set() and rt.store.held() == []


def test_the_worker_identity_is_fixed_once_and_beats(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "get_runtime", lambda: rt)
    monkeypatch.setattr(liveness, "_identity", None)
    me = liveness.register(["run", "run.node-a"])
    assert liveness.owner(rt) == me
    assert rt.store.worker_alive(me)
    assert rt.store.node_alive("node-a", "run") and not rt.store.node_alive("node-a", "eval")


def test_a_stage_received_by_a_worker_that_died_before_beginning_it_is_sent_again(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = make_job(rt.store)
    rt.store.transition(job_id, JobStatus.init)
    rt.store.stage_finished(job_id, "init", 0.5)
    assert rt.store.reserve(job_id, f"{job_id}-run", DEAD, 0) == "reserved"
    [action] = sweep(rt, later(rt))
    assert (action.what, action.stage, action.attempt) == ("requeued", "run", 1)
    assert [m["args"] for m in queued(redis_client, "run")] == [[job_id, 1]]
    # the lost attempt's message is not noted again when it comes back
    assert rt.store.reserve(job_id, f"{job_id}-run", LIVE, 0) == "stale"
    # the new attempt's message, received by a worker that dies too, is taken over again
    assert rt.store.reserve(job_id, f"{job_id}-run", DEAD, 1) == "reserved"
    assert not rt.store.holdings([job_id])[job_id].pending
    [again] = sweep(rt, later(rt))
    assert (again.what, again.attempt) == ("requeued", 2)


def fetch_into_unacked(r: redis.Redis, queue: str, fetched_at: float) -> None:
    """Do what kombu does when a worker fetches a message: move it to the unacked hash."""
    raw = r.rpop(queue)
    assert raw is not None
    r.hset("unacked", "tag-1", json.dumps([json.loads(raw), "", queue]))
    r.zadd("unacked_index", {"tag-1": fetched_at})


def test_a_message_fetched_by_a_worker_that_died_before_noting_it_is_sent_again(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = make_job(rt.store)
    rt.store.transition(job_id, JobStatus.init)
    rt.store.stage_finished(job_id, "init", 0.5)
    rt.dispatcher.send_again(job_id, rt.store.get(job_id).task_ids, "run", 0)
    fetch_into_unacked(redis_client, "run", time.time())
    assert sweep(rt, time.time()) == []  # just fetched: its worker may be noting it
    rt.store.stage_finished(job_id, "run", 1.0)
    assert sweep(rt, later(rt)) == []  # its stage is done: it is about to be acknowledged
    redis_client.hdel(f"rs:job:{job_id}", "dur_run")
    [action] = sweep(rt, later(rt))
    assert (action.what, action.stage, action.attempt) == ("requeued", "run", 1)
    assert [m["args"] for m in queued(redis_client, "run")] == [[job_id, 1]]
    assert sweep(rt, later(rt)) == []  # the fetched message is an earlier attempt's now


def init_done(rt: Runtime, job_id: str) -> None:
    """The job's INIT ran and ended on a live worker (its RUN message is sent next)."""
    rt.store.transition(job_id, JobStatus.init)
    assert rt.store.begin_stage(job_id, f"{job_id}-init", LIVE, LIVE, 0) == "began"
    rt.store.stage_finished(job_id, "init", 0.5)
    rt.store.stage_end(job_id, f"{job_id}-init")


def test_a_message_lost_between_stages_is_sent_again_after_two_looks(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = make_job(rt.store)
    init_done(rt, job_id)
    assert rt.store.in_transit(time.time() + 1, 10) == [job_id]
    # nothing sent the RUN message (or a worker killed after Redis handed it over took it)
    assert sweep(rt, time.time()) == []  # not waiting long enough yet
    assert sweep(rt, later(rt)) == []  # a first look: it may be on its way to a worker
    [action] = sweep(rt, later(rt, 1))
    assert (action.job_id, action.what, action.stage, action.attempt) == (
        job_id,
        "requeued",
        "run",
        1,
    )
    assert queued(redis_client, "run") == [
        {"id": f"{job_id}-run", "args": [job_id, 1], "chain": ["rollserve.eval"]}
    ]
    assert rt.store.in_transit(later(rt, 10), 10) == []  # held (pending) now
    assert sweep(rt, later(rt, 2)) == []
    assert rt.store.reserve(job_id, f"{job_id}-run", LIVE, 1) == "reserved"
    assert len(queued(redis_client, "run")) == 1


def test_a_created_job_whose_init_message_never_went_out_is_sent(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    job_id = make_job(rt.store)
    assert sweep(rt, later(rt)) == []
    [action] = sweep(rt, later(rt, 1))
    assert (action.what, action.stage, action.attempt) == ("requeued", "init", 1)
    assert [(m["id"], m["args"]) for m in queued(redis_client, "init")] == [
        (f"{job_id}-init", [job_id, 1])
    ]


def test_messages_waiting_in_a_queue_or_fetched_by_a_worker_are_left_alone(
    rt: Runtime, redis_client: redis.Redis
) -> None:
    waiting, fetched, pinned = (make_job(rt.store) for _ in range(3))
    for job_id in (waiting, fetched, pinned):
        init_done(rt, job_id)
    ids = rt.store.get(waiting).task_ids
    rt.dispatcher.send_again(waiting, ids, "run", 0)
    rt.dispatcher.send_again(fetched, rt.store.get(fetched).task_ids, "run", 0)
    # the older one, `waiting`'s, fetched just now (a live worker notes it at once)
    fetch_into_unacked(redis_client, "run", later(rt, 10))
    rt.dispatcher.send_again(pinned, rt.store.get(pinned).task_ids, "run", 0, {"run": "run.b"})
    rt.store.pin(pinned, "node-b")  # a node queue the sweeper learns from the nodes it saw
    redis_client.rename("run.b", "run.node-b")
    looks = [later(rt, n * rt.settings.heartbeat_ttl) for n in range(3)]
    for now in looks:
        assert sweep(rt, now) == []
        # found, each is looked for again only a heartbeat's time to live later
        assert rt.store.in_transit(now - 0.5, 10) == []
        assert len(rt.store.in_transit(now + 0.5, 10)) == 3
    assert redis_client.llen("run") == 1 and redis_client.llen("run.node-b") == 1
    # a job that ends leaves the jobs in transit at the next look
    rt.store.transition(waiting, JobStatus.cancelled)
    assert sweep(rt, later(rt, 30)) == []
    assert waiting not in rt.store.in_transit(later(rt, 60), 10)


def test_sweeps_wait_until_the_heartbeat_has_gone_through_for_a_whole_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = time.monotonic()
    monkeypatch.setattr(liveness, "_beats", {"ok": now, "failed": 0.0})
    assert liveness.steady(20)
    monkeypatch.setattr(liveness, "_beats", {"ok": now, "failed": now - 5})  # Redis was away
    assert not liveness.steady(20)
    monkeypatch.setattr(liveness, "_beats", {"ok": now - 30, "failed": 0.0})  # beats stopped
    assert not liveness.steady(20)
