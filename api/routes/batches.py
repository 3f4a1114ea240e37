"""`/v1/batches`: groups of jobs, their progress and their results as a stream.

A batch with `dynamic_sampling` draws groups from its tasks until `target_groups` informative
groups are complete (see `workers/dapo.py`): `POST` answers with the first groups' jobs, the
results stream carries only the accepted groups' trajectories and ends once nothing of the
batch runs any more, and the progress carries the sampling statistics under `dynamic`.

A tenant sees, streams and cancels only its own batches: another tenant's id answers 404, as
an unknown id does (`api.owners`). The results stream and the wait of a cancel hold no thread
of the gateway while nothing happens (`api.waits`)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from api import owners, service, waits
from api.deps import Caller, caller, services, tenant
from api.errors import BATCH_LINKS, BY_ID, SUBMISSION
from api.ids import BatchId
from api.service import Services
from core.schemas import BatchAccepted, BatchProgress, BatchRequest

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post(
    "",
    status_code=202,
    response_model=BatchAccepted,
    responses={
        202: {"description": "Accepted: the batch's jobs are queued.", "links": BATCH_LINKS},
        **SUBMISSION,
    },
)
def submit(
    body: BatchRequest, svc: Services = Depends(services), who: str = Depends(tenant)
) -> BatchAccepted:
    batch_id, jobs = service.submit_batch(svc, body, who)
    return BatchAccepted(batch_id=batch_id, jobs=jobs)


@router.get("/{batch_id}", response_model=BatchProgress, responses=BY_ID)
def progress(
    batch_id: BatchId, svc: Services = Depends(services), me: Caller = Depends(caller)
) -> BatchProgress:
    owners.check_batch(svc.store, me.tenant, me.admin, batch_id)
    return service.batch_progress(svc, batch_id)


def _open_stream(svc: Services, me: Caller, batch_id: str, after: str | None) -> str | None:
    """The stream's start, or the refusal: 404 for a batch not the caller's (before any
    cursor is read), 422 naming `after`."""
    owners.check_batch(svc.store, me.tenant, me.admin, batch_id)
    svc.store.batch_progress(batch_id)  # 404 before the stream starts
    return service.resume_point(svc, batch_id, after)  # 422 naming `after`


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}, **BY_ID},
)
async def results(
    batch_id: BatchId,
    after: str | None = Query(
        None,
        max_length=100,
        description="the `cursor` of a line of this stream: resume right after that line",
    ),
    svc: Services = Depends(services),
    me: Caller = Depends(caller),
    r: aioredis.Redis = Depends(waits.async_redis),
) -> StreamingResponse:
    """Finished trajectories as NDJSON, each as soon as it finishes; ends when all have.

    Every line carries `cursor`, its place in the batch's ordered log of results; `?after=`
    with it resumes right after that line, on any gateway. Blank lines are keep-alives.

    For a dynamic batch: the trajectories of each accepted group as it is accepted, exactly
    `target_groups` groups (fewer if the pool ran out); ends once the batch is done, when no
    job of it runs and no sandbox or backend slot of it is held."""
    entry_id = await asyncio.to_thread(_open_stream, svc, me, batch_id, after)
    return StreamingResponse(
        waits.result_lines(svc, r, batch_id, entry_id), media_type="application/x-ndjson"
    )


@router.delete("/{batch_id}", response_model=BatchProgress, responses=BY_ID)
async def cancel(
    batch_id: BatchId,
    wait: float = Query(
        30.0,
        ge=0.0,
        allow_inf_nan=False,
        description="seconds to wait until every cancelled job has stopped "
        "(at most ROLLSERVE_MAX_WAIT_SECONDS)",
    ),
    svc: Services = Depends(services),
    me: Caller = Depends(caller),
) -> BatchProgress:
    """Stop all work of the batch: queued stage tasks revoked, running ones terminated, their
    sandboxes and backend slots freed. Answers once that is confirmed (`done`) or after
    `wait` seconds."""
    await asyncio.to_thread(owners.check_batch, svc.store, me.tenant, me.admin, batch_id)
    return await waits.cancel_batch(svc, batch_id, wait)
