"""The gateway's plain functions (`api/service.py`) called directly on `Services` over a real
Redis: no HTTP server, no worker. Sent jobs simply sit in the Celery queue, where they are read
back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from api import service
from api.app import build_services
from api.service import (
    RequestError,
    Services,
    batch_progress,
    cancel_batch,
    cancel_jobs,
    check_seed_span,
    instance_id_of,
    resolve_dynamic,
    submit_batch,
    submit_rollout,
    wait_for_job,
)
from broker.jobstore import JobNotFound
from core.schemas import (
    MAX_SEED,
    BackendSpec,
    BatchRequest,
    JobStatus,
    RolloutRequest,
    SamplingParams,
    Task,
)
from core.settings import Settings

TENANT = "tenant-a"


def math_task(n: int = 1, **extra: Any) -> dict[str, Any]:
    return {"data_source": "math", "problem": f"What is {n}+{n}?", "answer": str(2 * n), **extra}


def rollout(task: dict[str, Any] | None = None, **fields: Any) -> RolloutRequest:
    return RolloutRequest.model_validate({"task": task or math_task(), **fields})


def batch(tasks: list[dict[str, Any]], **fields: Any) -> BatchRequest:
    return BatchRequest.model_validate({"tasks": tasks, **fields})


MakeServices = Callable[..., Services]


@pytest.fixture
def make_services(redis_url: str) -> Iterator[MakeServices]:
    """Services over the test's Redis, with settings overridden as given."""
    made: list[Services] = []

    def make(**overrides: Any) -> Services:
        svc = build_services(Settings(redis_url=redis_url, node_name="gateway", **overrides))
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.celery.close()
        svc.store.r.close()


@pytest.fixture
def svc(make_services: MakeServices) -> Services:
    services = make_services(max_tokens=256)
    add_backend(services)
    return services


def add_backend(svc: Services, name: str = "b1", context: int | None = None) -> None:
    svc.pool.register(
        BackendSpec(url=f"http://{name}.invalid:8000", model="m", id=name), max_model_len=context
    )


def sent(r: redis.Redis) -> list[str]:
    """The task ids of the INIT messages waiting in the Celery queue, oldest first."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(r.lrange("init", 0, -1))]


def job_records(r: redis.Redis) -> list[str]:
    return sorted(r.scan_iter("rs:job:*"))


def assert_nothing_written(r: redis.Redis, svc: Services) -> None:
    assert job_records(r) == []
    assert list(r.scan_iter("rs:batch:*")) == []
    assert sent(r) == []
    assert svc.store.unfinished(TENANT) == 0


def refusal(call: Callable[[], Any]) -> RequestError:
    with pytest.raises(RequestError) as caught:
        call()
    return caught.value


# ----------------------------------------------------------------------------- one rollout


def test_a_rollout_is_written_queued_with_resolved_parameters_and_sent(
    svc: Services, redis_client: redis.Redis
) -> None:
    request = rollout(
        math_task(instance_id="q-1"),
        sampling={"temperature": 0.5, "seed": 3},
        agent={"max_total_tokens": 300},
    )
    job_id = submit_rollout(svc, request, tenant=TENANT)
    record = svc.store.get(job_id)
    assert record.status is JobStatus.queued
    assert record.task == math_task(instance_id="q-1")
    assert (record.data_source, record.instance_id) == ("math", "q-1")
    assert record.batch_id is None and record.sample_index == 0
    # Unset parameters are resolved from the settings when the job is written.
    assert record.sampling["max_tokens"] == 256
    assert (record.sampling["temperature"], record.sampling["seed"]) == (0.5, 3)
    assert record.agent == {"max_turns": svc.settings.max_turns, "max_total_tokens": 300}
    assert sent(redis_client) == [f"{job_id}-init"]
    assert svc.store.unfinished(TENANT) == 1
    assert svc.store.unfinished("someone-else") == 0


def test_a_task_without_an_instance_id_gets_one_from_its_content(svc: Services) -> None:
    first = svc.store.get(submit_rollout(svc, rollout(math_task(1)))).instance_id
    again = svc.store.get(submit_rollout(svc, rollout(math_task(1)))).instance_id
    other = svc.store.get(submit_rollout(svc, rollout(math_task(2)))).instance_id
    assert first == again != other
    assert first.startswith("math-")
    assert instance_id_of(Task.model_validate(math_task(1))) == first


@pytest.mark.parametrize(
    ("task", "loc"),
    [
        ({"data_source": "nope", "problem": "x"}, ["body", "task", "data_source"]),
        ({"data_source": "math", "problem": "1+1"}, ["body", "task", "answer"]),
        ({"data_source": "math", "answer": "2"}, ["body", "task", "problem"]),
        (math_task(meta={"x": [1.0, float("nan")]}), ["body", "task", "meta", "x", 1]),
    ],
    ids=["unknown-handler", "no-answer", "no-problem", "nan"],
)
def test_a_task_that_cannot_run_is_refused_naming_its_field_and_nothing_is_written(
    svc: Services, redis_client: redis.Redis, task: dict[str, Any], loc: list[str | int]
) -> None:
    error = refusal(lambda: submit_rollout(svc, rollout(task), tenant=TENANT))
    assert (error.status_code, error.loc) == (422, loc)
    assert_nothing_written(redis_client, svc)


def test_an_unknown_data_source_is_refused_with_the_known_ones(svc: Services) -> None:
    error = refusal(lambda: submit_rollout(svc, rollout({"data_source": "nope"})))
    assert "unknown data_source 'nope'" in error.message
    assert "math" in error.message


def test_without_a_backend_nothing_is_accepted(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services()
    error = refusal(lambda: submit_rollout(svc, rollout(), tenant=TENANT))
    assert error.status_code == 503
    assert "/v1/backends" in error.message
    assert_nothing_written(redis_client, svc)
    error = refusal(lambda: submit_batch(svc, batch([math_task()]), tenant=TENANT))
    assert error.status_code == 503
    assert_nothing_written(redis_client, svc)


def test_max_tokens_is_bounded_by_the_largest_reported_context(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services()
    add_backend(svc, "small", context=1000)
    add_backend(svc, "large", context=2000)
    error = refusal(lambda: submit_rollout(svc, rollout(sampling={"max_tokens": 2001})))
    assert (error.status_code, error.loc) == (422, ["body", "sampling", "max_tokens"])
    assert "2000" in error.message
    assert sent(redis_client) == []
    job_id = submit_rollout(svc, rollout(sampling={"max_tokens": 2000}))
    assert svc.store.get(job_id).sampling["max_tokens"] == 2000


def test_max_tokens_is_unbounded_when_no_backend_reported_a_context(svc: Services) -> None:
    job_id = submit_rollout(svc, rollout(sampling={"max_tokens": 1 << 20}))
    assert svc.store.get(job_id).sampling["max_tokens"] == 1 << 20


def test_a_task_over_the_size_limit_is_refused_with_413(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services(max_task_bytes=300)
    add_backend(svc)
    big = math_task(problem="x" * 400)
    error = refusal(lambda: submit_rollout(svc, rollout(big), tenant=TENANT))
    assert (error.status_code, error.loc) == (413, ["body", "task"])
    assert "ROLLSERVE_MAX_TASK_BYTES" in error.message
    error = refusal(lambda: submit_batch(svc, batch([math_task(), big]), tenant=TENANT))
    assert (error.status_code, error.loc) == (413, ["body", "tasks", 1])
    assert_nothing_written(redis_client, svc)


def test_a_tenant_over_its_quota_is_refused_until_its_jobs_end(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services(max_queued_jobs=2)
    add_backend(svc)
    first = submit_rollout(svc, rollout(), tenant=TENANT)
    submit_rollout(svc, rollout(), tenant=TENANT)
    error = refusal(lambda: submit_rollout(svc, rollout(), tenant=TENANT))
    assert error.status_code == 429
    assert "ROLLSERVE_MAX_QUEUED_JOBS" in error.message
    assert len(job_records(redis_client)) == 2
    # Another tenant has its own quota; a batch counts all its jobs.
    submit_rollout(svc, rollout(), tenant="tenant-b")
    error = refusal(
        lambda: submit_batch(svc, batch([math_task()], group_size=2), tenant="tenant-b")
    )
    assert error.status_code == 429
    # An ended job no longer counts.
    svc.store.finish(first, JobStatus.completed)
    submit_rollout(svc, rollout(), tenant=TENANT)
    assert svc.store.unfinished(TENANT) == 2


def test_jobs_whose_records_expired_do_not_hold_the_quota(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services(max_queued_jobs=1)
    add_backend(svc)
    job_id = submit_rollout(svc, rollout(), tenant=TENANT)
    redis_client.delete(f"rs:job:{job_id}")  # as if its record had expired
    submit_rollout(svc, rollout(), tenant=TENANT)
    assert svc.store.unfinished(TENANT) == 1


# ----------------------------------------------------------------------------- batches


def test_a_batch_is_written_as_groups_of_samples_and_every_job_is_sent(
    svc: Services, redis_client: redis.Redis
) -> None:
    batch_id, jobs = submit_batch(
        svc, batch([math_task(1), math_task(2)], group_size=3), tenant=TENANT
    )
    assert len(jobs) == 6
    assert sent(redis_client) == [f"{j}-init" for j in jobs]
    records = [svc.store.get(j) for j in jobs]
    assert [r.sample_index for r in records] == [0, 1, 2, 0, 1, 2]
    assert {r.batch_id for r in records} == {batch_id}
    assert len({r.group_id for r in records[:3]}) == 1
    assert len({r.group_id for r in records[3:]}) == 1
    assert records[0].group_id != records[3].group_id
    assert records[3].task["problem"] == math_task(2)["problem"]
    assert svc.store.unfinished(TENANT) == 6
    progress = batch_progress(svc, batch_id)
    assert (progress.total, progress.group_size, progress.groups_total) == (6, 3, 2)
    assert (progress.finished, progress.done, progress.dynamic) == (0, False, None)


def test_every_task_of_a_batch_is_checked_before_anything_is_written(
    svc: Services, redis_client: redis.Redis
) -> None:
    tasks = [math_task(1), {"data_source": "math", "problem": "no answer"}]
    error = refusal(lambda: submit_batch(svc, batch(tasks, group_size=2), tenant=TENANT))
    assert (error.status_code, error.loc) == (422, ["body", "tasks", 1, "answer"])
    assert_nothing_written(redis_client, svc)


def test_a_batch_over_the_job_limit_is_refused_with_413(
    make_services: MakeServices, redis_client: redis.Redis
) -> None:
    svc = make_services(max_jobs_per_request=5)
    add_backend(svc)
    error = refusal(lambda: submit_batch(svc, batch([math_task(1), math_task(2)], group_size=3)))
    assert (error.status_code, error.loc) == (413, ["body", "tasks"])
    assert "6 jobs" in error.message
    dynamic = batch(
        [math_task(i) for i in range(4)],
        group_size=2,
        dynamic_sampling={"target_groups": 1, "max_inflight_groups": 3},
    )
    error = refusal(lambda: submit_batch(svc, dynamic))
    assert (error.status_code, error.loc) == (
        413,
        ["body", "dynamic_sampling", "max_inflight_groups"],
    )
    assert_nothing_written(redis_client, svc)
    _, jobs = submit_batch(svc, batch([math_task(1)], group_size=5))
    assert len(jobs) == 5


def test_seeds_of_every_sample_must_stay_within_64_bits(svc: Services) -> None:
    check_seed_span(SamplingParams(seed=MAX_SEED - 1), 2)
    check_seed_span(SamplingParams(), 1000)
    error = refusal(lambda: check_seed_span(SamplingParams(seed=MAX_SEED - 1), 3))
    assert (error.status_code, error.loc) == (422, ["body", "sampling", "seed"])
    # With dynamic sampling each of a task's attempts takes a group's worth of seeds.
    dynamic = {"target_groups": 1, "max_attempts_per_task": 2}
    ok = batch(
        [math_task()], group_size=2, sampling={"seed": MAX_SEED - 3}, dynamic_sampling=dynamic
    )
    submit_batch(svc, ok)
    too_big = batch(
        [math_task()], group_size=2, sampling={"seed": MAX_SEED - 2}, dynamic_sampling=dynamic
    )
    error = refusal(lambda: submit_batch(svc, too_big))
    assert error.loc == ["body", "sampling", "seed"]


# ----------------------------------------------------------------------------- dynamic sampling


def test_a_plain_batch_has_no_dynamic_options() -> None:
    assert resolve_dynamic(batch([math_task()], group_size=4)) is None


def test_dynamic_options_get_their_defaults() -> None:
    options = resolve_dynamic(
        batch([math_task(i) for i in range(5)], group_size=4, dynamic_sampling={"target_groups": 3})
    )
    assert options is not None
    assert (options.target_groups, options.group_size, options.max_inflight_groups) == (3, 4, 3)
    assert (options.max_attempts_per_task, options.early_cancel) == (1, True)
    given = resolve_dynamic(
        batch(
            [math_task(i) for i in range(5)],
            dynamic_sampling={"target_groups": 2, "group_size": 6, "max_inflight_groups": 4},
        )
    )
    assert given is not None
    assert (given.group_size, given.max_inflight_groups) == (6, 4)
    same = resolve_dynamic(
        batch([math_task()], group_size=3, dynamic_sampling={"target_groups": 1, "group_size": 3})
    )
    assert same is not None and same.group_size == 3


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"group_size": 1, "dynamic_sampling": {"target_groups": 1}}, ["body", "group_size"]),
        (
            {"group_size": 4, "dynamic_sampling": {"target_groups": 1, "group_size": 2}},
            ["body", "dynamic_sampling", "group_size"],
        ),
        (
            {"group_size": 2, "dynamic_sampling": {"target_groups": 3}},
            ["body", "dynamic_sampling", "target_groups"],
        ),
    ],
    ids=["group-of-one", "two-group-sizes", "target-above-pool"],
)
def test_dynamic_options_that_cannot_work_are_refused_naming_the_field(
    svc: Services, redis_client: redis.Redis, fields: dict[str, Any], loc: list[str]
) -> None:
    request = batch([math_task(1), math_task(2)], **fields)
    error = refusal(lambda: resolve_dynamic(request))
    assert (error.status_code, error.loc) == (422, loc)
    assert refusal(lambda: submit_batch(svc, request, tenant=TENANT)).loc == loc
    assert_nothing_written(redis_client, svc)


def test_a_dynamic_batch_sends_only_its_first_groups(
    svc: Services, redis_client: redis.Redis
) -> None:
    request = batch(
        [math_task(i) for i in range(5)],
        group_size=2,
        dynamic_sampling={"target_groups": 2},
    )
    batch_id, jobs = submit_batch(svc, request, tenant=TENANT)
    assert len(jobs) == 4  # max_inflight_groups defaults to target_groups
    assert sent(redis_client) == [f"{j}-init" for j in jobs]
    assert svc.store.is_dynamic(batch_id)
    progress = batch_progress(svc, batch_id)
    assert progress.dynamic is not None
    assert (progress.dynamic.target_groups, progress.dynamic.pool_size) == (2, 5)
    assert progress.dynamic.groups_drawn == 2
    assert svc.store.unfinished(TENANT) == 4


# ----------------------------------------------------------------------------- progress and ends


def test_batch_progress_counts_ends_and_rewards(svc: Services) -> None:
    batch_id, jobs = submit_batch(svc, batch([math_task()], group_size=2))
    for job_id, reward in zip(jobs, [1.0, 0.0], strict=True):
        trajectory = svc.store.skeleton(svc.store.get(job_id))
        trajectory.reward = reward
        svc.store.finish(job_id, JobStatus.completed, trajectory)
        if reward:
            half = batch_progress(svc, batch_id)
            assert (half.finished, half.done, half.mean_reward) == (1, False, 1.0)
    progress = batch_progress(svc, batch_id)
    assert (progress.finished, progress.groups_finished, progress.done) == (2, 1, True)
    assert progress.mean_reward == 0.5
    assert progress.counts.get("completed") == 2
    with pytest.raises(JobNotFound):
        batch_progress(svc, "no-such-batch")


def test_cancel_jobs_cancels_live_jobs_once_and_frees_their_backend(svc: Services) -> None:
    live = submit_rollout(svc, rollout())
    done = submit_rollout(svc, rollout())
    svc.store.finish(done, JobStatus.completed)
    svc.pool.route(live)  # the job holds a backend slot
    assert svc.pool.backend_of(live) == "b1"

    assert cancel_jobs(svc, [live, done]) == 1
    cancelled = svc.store.trajectory(live)
    assert cancelled.status is JobStatus.cancelled
    assert cancelled.error is not None
    assert (cancelled.error.stage, cancelled.error.type) == ("queued", "cancelled")
    assert svc.pool.backend_of(live) is None
    assert svc.pool.in_flight() == {"b1": 0}
    assert svc.store.status(done) is JobStatus.completed
    assert cancel_jobs(svc, [live]) == 0


def test_cancelling_an_unknown_job_is_not_found_and_cancels_nothing(svc: Services) -> None:
    live = submit_rollout(svc, rollout())
    with pytest.raises(JobNotFound):
        cancel_jobs(svc, [live, "no-such-job"])
    assert svc.store.status(live) is JobStatus.queued


def test_cancel_batch_stops_every_job_and_reports_the_batch_done(svc: Services) -> None:
    batch_id, jobs = submit_batch(svc, batch([math_task(1), math_task(2)], group_size=2))
    svc.store.finish(jobs[0], JobStatus.completed)
    progress = cancel_batch(svc, batch_id, wait=30.0)
    assert progress.done
    assert progress.counts.get("cancelled") == 3
    assert progress.counts.get("completed") == 1
    assert all(svc.store.status(j).terminal for j in jobs)


def test_wait_for_job_returns_a_finished_trajectory_at_once(svc: Services) -> None:
    job_id = submit_rollout(svc, rollout())
    trajectory = svc.store.skeleton(svc.store.get(job_id))
    trajectory.reward = 1.0
    svc.store.finish(job_id, JobStatus.completed, trajectory)
    got = wait_for_job(svc, job_id, timeout=30.0)
    assert (got.job_id, got.status, got.reward) == (job_id, JobStatus.completed, 1.0)


def test_wait_for_job_blocks_until_the_job_ends(svc: Services, redis_client: redis.Redis) -> None:
    job_id = submit_rollout(svc, rollout())
    saw_waiter: list[bool] = []

    def finish_once_someone_waits() -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if any(c.get("cmd") == "blpop" for c in redis_client.client_list()):
                saw_waiter.append(True)
                break
            time.sleep(0.005)
        svc.store.finish(job_id, JobStatus.failed)

    finisher = threading.Thread(target=finish_once_someone_waits)
    finisher.start()
    try:
        got = wait_for_job(svc, job_id, timeout=120.0)
    finally:
        finisher.join()
    assert saw_waiter == [True]
    assert got.status is JobStatus.failed


def test_wait_for_job_waits_no_longer_than_the_configured_cap(
    make_services: MakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = make_services(max_wait_seconds=0.25)
    add_backend(svc)
    job_id = submit_rollout(svc, rollout())
    asked: list[float] = []
    real_wait = svc.store.wait

    def spy(job: str, timeout: float) -> JobStatus:
        asked.append(timeout)
        # Bounded here, so an uncapped wait fails the assertion below instead of hanging.
        return real_wait(job, min(timeout, 0.25))

    monkeypatch.setattr(svc.store, "wait", spy)
    got = wait_for_job(svc, job_id, timeout=3600.0)
    assert asked == [0.25]
    assert got.status is JobStatus.queued
    with pytest.raises(JobNotFound):
        wait_for_job(svc, "no-such-job", timeout=0.0)


def test_the_checks_name_the_location_they_are_given(make_services: MakeServices) -> None:
    svc = make_services(max_task_bytes=100, max_jobs_per_request=3, max_queued_jobs=1)
    add_backend(svc, context=50)
    loc: list[str | int] = ["body", "tasks", 7]
    service.check_token_limits(svc, SamplingParams(max_tokens=50), loc)
    error = refusal(lambda: service.check_token_limits(svc, SamplingParams(max_tokens=51), loc))
    assert (error.status_code, error.loc) == (422, [*loc, "max_tokens"])
    service.check_task_size(svc, Task.model_validate(math_task()), loc)
    big = Task.model_validate(math_task(problem="y" * 100))
    error = refusal(lambda: service.check_task_size(svc, big, loc))
    assert (error.status_code, error.loc) == (413, loc)
    service.check_job_count(svc, 3, "three", loc)
    error = refusal(lambda: service.check_job_count(svc, 4, "four things", loc))
    assert (error.status_code, error.loc) == (413, loc)
    assert error.message.startswith("four things make 4 jobs")
    service.check_quota(svc, TENANT, 1)
    error = refusal(lambda: service.check_quota(svc, TENANT, 2))
    assert (error.status_code, error.loc) == (429, [])
