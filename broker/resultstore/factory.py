"""The results store the settings name."""

from __future__ import annotations

from broker.resultstore.base import ResultsStore
from broker.resultstore.directory import DirectoryResults
from core.settings import Settings


def results_store(settings: Settings) -> ResultsStore:
    """The bucket of `ROLLSERVE_RESULTS_URL` when set, else the directory
    `ROLLSERVE_RESULTS_DIR` (default: `results` under the data directory)."""
    if settings.results_url:
        from broker.resultstore.s3 import S3Results

        return S3Results(
            settings.results_url, settings.results_keep, endpoint=settings.results_s3_endpoint
        )
    return DirectoryResults(settings.results_path, settings.results_keep)
