"""The shapes of job and batch ids, checked before an id becomes part of a Redis key.

The service makes every id itself: a batch id is a uuid4 in hex; a job id is a uuid4 in hex,
or `{batch id}-{group}-{sample}` for the jobs a dynamic batch draws (see `broker/jobstore/`).
An id of any other shape names nothing, so it is answered 404 before it reaches the store:
spliced into a key, `x:jobs` would address another record's key (Redis: WRONGTYPE). The
shapes are in the OpenAPI document as the parameters' `pattern`.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, HTTPException, Path

BATCH_ID = re.compile(r"[0-9a-f]{32}")
JOB_ID = re.compile(r"[0-9a-f]{32}(?:-[0-9]{1,12}-[0-9]{1,12})?")
JOB_ID_SHAPE = "32 hex digits, or `<batch id>-<group>-<sample>`"
BATCH_ID_SHAPE = "32 hex digits"


def job_id_param(
    job_id: Annotated[
        str,
        Path(
            description=f"The job's id ({JOB_ID_SHAPE}).",
            json_schema_extra={"pattern": f"^{JOB_ID.pattern}$"},
        ),
    ],
) -> str:
    """The `job_id` path parameter; 404 when no job can have it."""
    if not JOB_ID.fullmatch(job_id):
        raise HTTPException(
            status_code=404, detail=f"no job with id {job_id!r} (a job id is {JOB_ID_SHAPE})"
        )
    return job_id


def batch_id_param(
    batch_id: Annotated[
        str,
        Path(
            description=f"The batch's id ({BATCH_ID_SHAPE}).",
            json_schema_extra={"pattern": f"^{BATCH_ID.pattern}$"},
        ),
    ],
) -> str:
    """The `batch_id` path parameter; 404 when no batch can have it."""
    if not BATCH_ID.fullmatch(batch_id):
        raise HTTPException(
            status_code=404,
            detail=f"no batch with id {batch_id!r} (a batch id is {BATCH_ID_SHAPE})",
        )
    return batch_id


JobId = Annotated[str, Depends(job_id_param)]
BatchId = Annotated[str, Depends(batch_id_param)]
