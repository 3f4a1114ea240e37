"""The results store in an S3-compatible bucket, against a local S3 server (moto's): one
object per job, read by location or found by id, pruned by the hour. Skips when boto3 (the
`s3` extra) or moto's server is not installed."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.processes import free_port, spawn, stop_group, wait_for_port
from broker.resultstore import hour_of, results_store
from core.settings import Settings

boto3 = pytest.importorskip("boto3", reason="results in S3 need the `s3` extra (boto3)")
MOTO = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which(
    "moto_server"
)
pytestmark = pytest.mark.skipif(
    MOTO is None, reason="no local S3 server: pip install 'moto[server]'"
)

NOW = time.time()
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local S3 server with the bucket `results`; its URL."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    assert MOTO is not None
    proc = spawn([MOTO, "-H", "127.0.0.1", "-p", str(port)], log_path=str(tmp_path / "s3.log"))
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        url = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="results")
        yield url
    finally:
        stop_group(proc)


def store(endpoint: str, keep: int = 86400) -> Any:
    settings = Settings(
        results_url="s3://results/runs/a", results_s3_endpoint=endpoint, results_keep=keep
    )
    return results_store(settings)


def line(job_id: str) -> bytes:
    return json.dumps({"job_id": job_id}).encode()


def test_a_result_reads_back_from_its_object(endpoint: str) -> None:
    results = store(endpoint)
    location = results.put("j1", "b1", line("j1"), NOW)
    assert location == f"runs/a/{hour_of(NOW)}/j1.jsonl"
    assert results.read(location) == line("j1")
    assert results.read("runs/a/2000010100/none.jsonl") is None
    assert results.read("elsewhere/j1.jsonl") is None


def test_a_result_is_found_by_id_alone(endpoint: str) -> None:
    results = store(endpoint)
    results.put("j1", "b1", line("j1"), NOW - 3600)
    results.put("j2", None, line("j2"), NOW)
    assert results.find("j1") == line("j1")
    assert results.find("j2") == line("j2")
    assert results.find("j3") is None


def test_hours_past_the_window_are_pruned(endpoint: str) -> None:
    results = store(endpoint, keep=int(3.5 * 3600))
    old = results.put("old", "b1", line("old"), NOW - 5 * 3600)
    new = results.put("new", "b1", line("new"), NOW - 2 * 3600)
    assert results.prune(NOW) == [hour_of(NOW - 5 * 3600)]
    assert results.read(old) is None
    assert results.read(new) == line("new")
