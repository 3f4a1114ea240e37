"""`/v1/rollouts`: one job.

A tenant reads and cancels only its own jobs: another tenant's id answers 404, as an unknown
id does (`api.owners`). The `?wait=true` of a submission waits on the event loop
(`api.waits`), holding no thread of the gateway."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from api import owners, service
from api.deps import Caller, caller, services, tenant
from api.errors import BY_ID, ROLLOUT_LINKS, SUBMISSION
from api.ids import JobId
from api.service import Services
from api.waits import async_redis, await_job
from core.schemas import RolloutAccepted, RolloutRequest, Trajectory

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"])


@router.post(
    "",
    status_code=202,
    response_model=RolloutAccepted,
    responses={
        200: {"model": Trajectory, "description": "finished within `timeout` (wait=true)"},
        202: {"description": "Accepted: the job is queued.", "links": ROLLOUT_LINKS},
        **SUBMISSION,
    },
)
async def submit(
    body: RolloutRequest,
    wait: bool = Query(False, description="block until the job finishes"),
    timeout: float = Query(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds to block with wait=true (at most ROLLSERVE_MAX_WAIT_SECONDS)",
    ),
    svc: Services = Depends(services),
    who: str = Depends(tenant),
    r: aioredis.Redis = Depends(async_redis),
) -> RolloutAccepted | JSONResponse:
    job_id = await asyncio.to_thread(service.submit_rollout, svc, body, who)
    if wait:
        trajectory = await await_job(svc, r, job_id, timeout)
        if trajectory.status.terminal:
            return JSONResponse(trajectory.model_dump(mode="json"), status_code=200)
    return RolloutAccepted(job_id=job_id)


@router.get("/{job_id}", response_model=Trajectory, responses=BY_ID)
def get(
    job_id: JobId, svc: Services = Depends(services), me: Caller = Depends(caller)
) -> Trajectory:
    """The job's trajectory: final when it has finished, partial while it runs."""
    owners.check_job(svc.store, me.tenant, me.admin, job_id)
    return service.deliver(svc, job_id)


@router.delete("/{job_id}", response_model=Trajectory, responses=BY_ID)
def cancel(
    job_id: JobId, svc: Services = Depends(services), me: Caller = Depends(caller)
) -> Trajectory:
    """Cancel the job (a finished job is left as it is) and return what it has."""
    owners.check_job(svc.store, me.tenant, me.admin, job_id)
    service.cancel_jobs(svc, [job_id])
    return svc.store.trajectory(job_id)
