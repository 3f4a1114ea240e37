"""Finished trajectories in an S3-compatible bucket: one object per job, by hour.

`s3://bucket/prefix` holds `{prefix}/{YYYYmmddHH}/{job_id}.jsonl` (one JSON line) per job that
finished in that hour. A put is acknowledged by the bucket only once stored whole, so there
are no partial objects. Needs boto3 (the `s3` extra); credentials and region come from the
usual AWS settings (environment, shared config), the endpoint from
`ROLLSERVE_RESULTS_S3_ENDPOINT` for a server other than AWS.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from broker.resultstore.base import ResultsStore, hour_of, safe_name


class S3Results(ResultsStore):
    """Results in `bucket` under `prefix`, kept `keep` seconds."""

    def __init__(
        self, url: str, keep: float, endpoint: str | None = None, client: Any = None
    ) -> None:
        super().__init__(keep)
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            try:
                import boto3
            except ImportError as exc:  # an optional extra
                raise RuntimeError(
                    "results in S3 need boto3: install rollserve with the `s3` extra"
                ) from exc
            client = boto3.client("s3", endpoint_url=endpoint or None)
        self.client = client

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def put(self, job_id: str, batch_id: str | None, line: bytes, now: float) -> str:
        self.prune_hourly(now)
        key = self._key(hour_of(now), f"{safe_name(job_id)}.jsonl")
        self.client.put_object(Bucket=self.bucket, Key=key, Body=line + b"\n")
        return key

    def read(self, location: str) -> bytes | None:
        if not location.startswith(self._key()):
            return None
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=location)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        data = bytes(body)
        return data[:-1] if data.endswith(b"\n") else None

    def find(self, job_id: str) -> bytes | None:
        for hour in reversed(self.hours()):
            found = self.read(self._key(hour, f"{safe_name(job_id)}.jsonl"))
            if found is not None:
                return found
        return None

    def hours(self) -> list[str]:
        base = self._key() + "/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base, Delimiter="/"
        )
        found = []
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(base) :].rstrip("/")
                if len(name) == 10 and name.isdigit():
                    found.append(name)
        return sorted(found)

    def drop_hour(self, hour: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(hour) + "/"
        )
        for page in pages:
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
