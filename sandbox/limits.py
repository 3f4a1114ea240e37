"""The box-wide limits a sandbox ran into, kept for its trajectory.

A box held by a limit says so only in words its programs chose ("No space left on device",
"Killed", "fork: retry"), which the model may print too. What is recorded here comes from
what the host sees of the box instead, in `<state dir>/limits.jsonl` (one JSON line per
sighting, up to `MAX_BYTES`), folded by `read_limit_hits` into one `LimitHit` per limit:

- after each call of the agent's tools (`sandbox.toolclient`): a call that ran out of its time
  and was interrupted (`time`), and the box's own disk (`sandbox.boxdisk`) found full
  (`disk`) or out of inodes (`inodes`) once the call is over;
- when the box is halted or stopped (`sandbox.process`): its cgroup's counters, the OOM kills
  of its memory limit (`memory`) and the forks its process limit refused (`processes`), and
  its disk as above.

What it does not see: a disk filled and emptied again within one tool call (the command that
hit ENOSPC is then told so, the record is not), and limits of a box without a disk or a
cgroup of its own (not root, no cgroups for boxes: see `GET /v1/stats`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.schemas import LIMIT_NAMES, LimitHit
from sandbox.boxdisk import DISK_DIR
from sandbox.cgroups import read_counters

LOG_NAME = "limits.jsonl"
"""The limit sightings of a sandbox, in its state dir."""
MAX_BYTES = 256 << 10
"""Size of the record past which no sighting is added (a box that runs out of time on every
call stops adding; the counts it holds stay)."""
FULL_SHARE = 0.01
"""A disk with less than this share of its blocks (or inodes) free counts as full: a write
that fails with ENOSPC leaves at most a few pages behind."""

_lock = threading.Lock()


def disk_state(state_dir: Path) -> list[tuple[str, str]]:
    """(limit, detail) for the box's own disk when it is full or out of inodes now (empty
    for a disk with room, or a box without a disk of its own)."""
    disk = state_dir / DISK_DIR
    try:
        if not os.path.ismount(disk):
            return []
        stats = os.statvfs(disk)
    except OSError:
        return []
    found = []
    if stats.f_blocks and stats.f_bavail <= stats.f_blocks * FULL_SHARE:
        size = stats.f_blocks * stats.f_frsize
        found.append(("disk", f"the box's disk ({size >> 20} MiB) was full"))
    if stats.f_files and stats.f_favail <= stats.f_files * FULL_SHARE:
        found.append(("inodes", f"the box's disk had no inode left ({stats.f_files} in all)"))
    return found


def record(
    state_dir: Path, limit: str, detail: str, *, count: int = 1, counter: bool = False
) -> None:
    """Add one sighting of `limit` to the sandbox's record. `counter`: `count` is the box's
    running total (a cgroup counter), which replaces earlier totals instead of adding to them."""
    if limit not in LIMIT_NAMES:
        raise ValueError(f"not a box limit: {limit!r}")
    line = json.dumps({"limit": limit, "count": count, "counter": counter, "detail": detail})
    path = state_dir / LOG_NAME
    with _lock, contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as file:
        if file.tell() < MAX_BYTES:
            file.write(line + "\n")


def note_tool_call(state_dir: Path, tool: str, result: dict[str, Any] | None) -> None:
    """Record what one call of the agent's tools ran into: its time (`result` says it timed
    out; None: no answer came in time at all) and the box's disk once it is over."""
    timed_out = result is None or bool(result.get("timed_out")) or result.get("status") == "timeout"
    if timed_out and tool in ("bash", "ipython"):
        record(state_dir, "time", f"a {tool} call ran out of time and was interrupted")
    for limit, detail in disk_state(state_dir):
        record(state_dir, limit, detail)


def note_box_end(state_dir: Path, cgroup: Iterable[str] | None) -> None:
    """Record the box's cgroup counters and its disk (at a halt or a stop)."""
    counters = read_counters(list(cgroup or ()))
    if counters.oom_kills:
        detail = "the kernel killed a process of the box for its memory limit"
        record(state_dir, "memory", detail, count=counters.oom_kills, counter=True)
    if counters.pids_refused:
        detail = "a fork was refused for the box's process limit"
        record(state_dir, "processes", detail, count=counters.pids_refused, counter=True)
    for limit, detail in disk_state(state_dir):
        record(state_dir, limit, detail)


def read_limit_hits(state_dir: Path) -> list[LimitHit]:
    """One `LimitHit` per limit the sandbox's record names, in `LIMIT_NAMES` order: the
    latest counter total or the number of sightings, whichever is larger."""
    try:
        lines = (state_dir / LOG_NAME).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    totals: dict[str, int] = {}
    sightings: dict[str, int] = {}
    details: dict[str, str] = {}
    for line in lines:
        try:
            entry = json.loads(line)
            limit, count = str(entry["limit"]), int(entry["count"])
        except (ValueError, KeyError, TypeError):
            continue
        if limit not in LIMIT_NAMES:
            continue
        if entry.get("counter"):
            totals[limit] = max(totals.get(limit, 0), count)
        else:
            sightings[limit] = sightings.get(limit, 0) + count
        details.setdefault(limit, str(entry.get("detail", "")))
    return [
        LimitHit(
            limit=limit,  # type: ignore[arg-type]
            count=max(1, totals.get(limit, 0), sightings.get(limit, 0)),
            detail=details[limit],
        )
        for limit in LIMIT_NAMES
        if limit in details
    ]
