"""The results store: where finished trajectories live once they leave Redis.

At a job's end the job store writes its final trajectory here (one JSON line) and keeps in
Redis only the job's record with the line's location; reads of the job, and the batch result
stream, fetch the line from here. Two kinds, one interface (`ResultsStore`):

- a directory (`DirectoryResults`, the default: `ROLLSERVE_RESULTS_DIR`, under the data
  directory): append-only JSON Lines, one file per batch per hour of finishing, each line
  written whole and fsync'd under a file lock; a per-hour index finds a line by job id when
  Redis no longer knows where it is;
- an S3-compatible bucket (`S3Results`, `ROLLSERVE_RESULTS_URL=s3://bucket/prefix`; needs the
  `s3` extra), one object per job under a prefix per hour of finishing.

Both are partitioned by the hour of finishing, so results older than `ROLLSERVE_RESULTS_KEEP`
seconds are pruned by deleting whole hours, at most once an hour per process, when writing.
A fleet on several machines needs the directory on a shared file system, or the bucket.
"""

from __future__ import annotations

from broker.resultstore.base import ResultsStore, hour_of, safe_name
from broker.resultstore.directory import DirectoryResults
from broker.resultstore.factory import results_store

__all__ = ["DirectoryResults", "ResultsStore", "hour_of", "results_store", "safe_name"]
