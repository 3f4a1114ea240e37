"""Finished trajectories in a directory: append-only JSON Lines, partitioned by hour.

`{root}/{YYYYmmddHH}/{batch}.jsonl` holds the trajectories of one batch (`rollouts.jsonl`:
jobs outside batches) that finished in that hour, one per line; `{root}/{hour}/index/XX.tsv`
names, per line, `job_id`, file, offset and length of the jobs whose id starts with `XX`, so a
job is found without reading the data, and a lookup reads one small shard per hour (a request
for an id that was never there costs no more than that). Writers append under an exclusive
`flock` of the file and fsync before answering, so concurrent workers never interleave lines;
a line a crash left half-written is never named by a location (its writer had not answered)
and reads as incomplete anyway, and the next writer ends it with a newline first, so
line-by-line readers skip it as one bad line.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from broker.resultstore.base import ResultsStore, hour_of, safe_name

INDEX = "index"
"""The directory, in each hour, of the index shards (one per first two characters of the id)."""


def _shard(job_id: str) -> str:
    return f"{INDEX}/{safe_name(job_id[:2]) or '_'}.tsv"


def _append(path: Path, data: bytes) -> int:
    """Append `data` to `path` whole, fsync'd; returns the offset it starts at."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # a writer died mid-line: end that line so ours starts on its own
            os.write(fd, b"\n")
            size += 1
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        return size
    finally:
        os.close(fd)  # closing releases the lock


class DirectoryResults(ResultsStore):
    """Results under `root` (created on first write), kept `keep` seconds."""

    def __init__(self, root: Path, keep: float) -> None:
        super().__init__(keep)
        self.root = Path(root)

    def put(self, job_id: str, batch_id: str | None, line: bytes, now: float) -> str:
        if b"\n" in line:
            raise ValueError("a result line holds no newline")
        self.prune_hourly(now)
        hour = hour_of(now)
        part = self.root / hour
        if not part.is_dir():
            part.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root)
        name = f"{safe_name(batch_id) if batch_id else 'rollouts'}.jsonl"
        offset = _append(part / name, line + b"\n")
        length = len(line) + 1
        shard = part / _shard(job_id)
        if not shard.parent.is_dir():
            shard.parent.mkdir(exist_ok=True)
            _fsync_dir(part)
        _append(shard, f"{job_id}\t{name}\t{offset}\t{length}\n".encode())
        return f"{hour}/{name}:{offset}:{length}"

    def read(self, location: str) -> bytes | None:
        try:
            rel, offset, length = location.rsplit(":", 2)
            hour, name = rel.split("/")
            start, size = int(offset), int(length)
        except ValueError:
            return None
        if safe_name(hour) != hour or safe_name(name) != name or start < 0 or size < 2:
            return None
        try:
            with open(self.root / hour / name, "rb") as f:
                data = os.pread(f.fileno(), size, start)
        except OSError:
            return None
        if len(data) != size or not data.endswith(b"\n"):
            return None
        return data[:-1]

    def find(self, job_id: str) -> bytes | None:
        key = f"{job_id}\t".encode()
        for hour in reversed(self.hours()):
            try:
                index = (self.root / hour / _shard(job_id)).read_bytes()
            except OSError:
                continue
            at = index.rfind(b"\n" + key)
            at = at + 1 if at >= 0 else (0 if index.startswith(key) else -1)
            if at < 0:
                continue
            end = index.find(b"\n", at)
            if end < 0:
                continue  # the index line itself is incomplete
            fields = index[at:end].decode().split("\t")
            if len(fields) != 4:
                continue
            found = self.read(f"{hour}/{fields[1]}:{fields[2]}:{fields[3]}")
            if found is not None:
                return found
        return None

    def hours(self) -> list[str]:
        try:
            names = [p.name for p in self.root.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if len(n) == 10 and n.isdigit())

    def drop_hour(self, hour: str) -> None:
        shutil.rmtree(self.root / hour, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make a new entry of directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
