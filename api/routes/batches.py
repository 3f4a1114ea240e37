"""`/v1/batches`: groups of jobs, their progress and their results as a stream.

A batch with `dynamic_sampling` draws groups from its tasks until `target_groups` informative
groups are complete (see `workers/dapo.py`): `POST` answers with the first groups' jobs, the
results stream carries only the accepted groups' trajectories and ends once nothing of the
batch runs any more, and the progress carries the sampling statistics under `dynamic`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from api import service
from api.deps import services, tenant
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
def progress(batch_id: BatchId, svc: Services = Depends(services)) -> BatchProgress:
    return service.batch_progress(svc, batch_id)


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}, **BY_ID},
)
def results(
    batch_id: BatchId,
    after: str | None = Query(
        None,
        max_length=100,
        description="the `cursor` of a line of this stream: resume right after that line",
    ),
    svc: Services = Depends(services),
) -> StreamingResponse:
    """Finished trajectories as NDJSON, each as soon as it finishes; ends when all have.

    Every line carries `cursor`, its place in the batch's ordered log of results; `?after=`
    with it resumes right after that line, on any gateway. Blank lines are keep-alives.

    For a dynamic batch: the trajectories of each accepted group as it is accepted, exactly
    `target_groups` groups (fewer if the pool ran out); ends once the batch is done, when no
    job of it runs and no sandbox or backend slot of it is held."""
    svc.store.batch_progress(batch_id)  # 404 before the stream starts
    entry_id = service.resume_point(svc, batch_id, after)  # 422 naming `after`
    return StreamingResponse(
        service.stream_results(svc, batch_id, entry_id), media_type="application/x-ndjson"
    )


@router.delete("/{batch_id}", response_model=BatchProgress, responses=BY_ID)
def cancel(
    batch_id: BatchId,
    wait: float = Query(
        30.0,
        ge=0.0,
        allow_inf_nan=False,
        description="seconds to wait until every cancelled job has stopped "
        "(at most ROLLSERVE_MAX_WAIT_SECONDS)",
    ),
    svc: Services = Depends(services),
) -> BatchProgress:
    """Stop all work of the batch: queued stage tasks revoked, running ones terminated, their
    sandboxes and backend slots freed. Answers once that is confirmed (`done`) or after
    `wait` seconds."""
    return service.cancel_batch(svc, batch_id, wait)
