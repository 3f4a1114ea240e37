"""`/v1/batches`: groups of jobs, their progress and their results as a stream."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from api import service
from api.deps import services
from api.schemas import BatchAccepted, BatchProgress, BatchRequest
from api.service import Services

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post("", status_code=202, response_model=BatchAccepted)
def submit(body: BatchRequest, svc: Services = Depends(services)) -> BatchAccepted:
    batch_id, jobs = service.submit_batch(svc, body)
    return BatchAccepted(batch_id=batch_id, jobs=jobs)


@router.get("/{batch_id}", response_model=BatchProgress)
def progress(batch_id: str, svc: Services = Depends(services)) -> BatchProgress:
    return svc.store.batch_progress(batch_id)


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
def results(batch_id: str, svc: Services = Depends(services)) -> StreamingResponse:
    """Finished trajectories as NDJSON, each as soon as it finishes; ends when all have."""
    svc.store.batch_progress(batch_id)  # 404 before the stream starts
    return StreamingResponse(
        service.stream_results(svc, batch_id), media_type="application/x-ndjson"
    )


@router.delete("/{batch_id}", response_model=BatchProgress)
def cancel(batch_id: str, svc: Services = Depends(services)) -> BatchProgress:
    return service.cancel_batch(svc, batch_id)
