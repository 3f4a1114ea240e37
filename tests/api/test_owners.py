"""Who may see what (`api.deps.caller_of`, `api.owners`), called directly over a real Redis:
the operator's token is the admin, a tenant owns what it submitted and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from api import owners
from api.deps import Caller, caller_of
from api.service import Services, owner_ttl, submit_batch, submit_rollout
from broker.jobstore import JobNotFound
from core.schemas import BatchRequest, JobStatus, RolloutRequest
from core.settings import Settings

TASK = {"data_source": "math", "problem": "What is 1+1?", "answer": "2"}


def bearer(token: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


def test_the_operators_token_is_the_admin_and_a_tenants_is_not() -> None:
    settings = Settings(api_token="op", tenant_tokens="alice:a")
    assert caller_of(settings, bearer("op")) == Caller("default", admin=True)
    assert caller_of(settings, bearer("a")) == Caller("alice", admin=False)
    assert caller_of(settings, bearer("nope")) is None
    assert caller_of(settings, None) is None


def test_without_tokens_everyone_is_an_admin() -> None:
    assert caller_of(Settings(), None) == Caller("anonymous", admin=True)


def test_a_batch_and_its_jobs_belong_to_their_submitter(svc: Services) -> None:
    batch_id, jobs = submit_batch(svc, BatchRequest.model_validate({"tasks": [TASK]}), "alice")
    assert owners.batch_owner(svc.store, batch_id) == "alice"
    assert {owners.job_owner(svc.store, job) for job in jobs} == {"alice"}
    owners.check_batch(svc.store, "alice", False, batch_id)
    owners.check_batch(svc.store, "default", True, batch_id)
    with pytest.raises(JobNotFound):
        owners.check_batch(svc.store, "mallory", False, batch_id)
    with pytest.raises(JobNotFound):
        owners.check_job(svc.store, "mallory", False, jobs[0])


def test_a_rollout_belongs_to_its_submitter_after_its_record_leaves(svc: Services) -> None:
    job_id = submit_rollout(svc, RolloutRequest.model_validate({"task": TASK}), "alice")
    svc.store.finish(job_id, JobStatus.completed, svc.store.skeleton(svc.store.get(job_id)))
    svc.store.r.delete(svc.store.job_key(job_id))
    assert owners.job_owner(svc.store, job_id) == "alice"
    with pytest.raises(JobNotFound):
        owners.check_job(svc.store, "mallory", False, job_id)


def test_a_job_of_a_batch_is_its_batchs_once_its_record_has_left(svc: Services) -> None:
    batch_id, jobs = submit_batch(svc, BatchRequest.model_validate({"tasks": [TASK]}), "alice")
    svc.store.finish(jobs[0], JobStatus.completed, svc.store.skeleton(svc.store.get(jobs[0])))
    svc.store.r.delete(svc.store.job_key(jobs[0]))
    assert svc.store.trajectory(jobs[0]).batch_id == batch_id  # from the results store
    assert owners.job_owner(svc.store, jobs[0]) == "alice"


def test_unknown_ids_have_no_owner(svc: Services) -> None:
    assert owners.job_owner(svc.store, "0" * 32) is None
    assert owners.batch_owner(svc.store, "0" * 32) is None


def test_a_tenant_lists_only_its_own_batches_newest_first(svc: Services) -> None:
    def submit(tenant: str) -> str:
        request: Any = BatchRequest.model_validate({"tasks": [TASK]})
        return submit_batch(svc, request, tenant)[0]

    first, other, second = submit("alice"), submit("mallory"), submit("alice")
    ttl = owner_ttl(svc.settings)
    rows, total = owners.tenant_batches(svc.store, "alice", ttl, 0, 10)
    assert [row["batch_id"] for row in rows] == [second, first] and total == 2
    rows, total = owners.tenant_batches(svc.store, "mallory", ttl, 0, 10)
    assert [row["batch_id"] for row in rows] == [other] and total == 1
