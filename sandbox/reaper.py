"""The orphan reaper: stops sandboxes whose job is over or whose lease ran out.

Each worker sweeps its host's state root now and then. A sandbox is reaped when its job is
no longer live, when its lease expired, or when its box is already gone (its owner crashed
and bubblewrap's --die-with-parent took the box along, leaving the state dir). Reaping kills
every process labelled with the sandbox's id, then removes its state dir. Sweeps may run
at the same time in several processes: a sandbox is reaped under its state dir's lock, by
whoever takes it first. Sandboxes another host recorded (a state root on a shared file
system) are left to that host. Grading boxes (`GRADING_DIR`) are swept with their state root,
and so are the job data dirs (`JOB_DATA_DIR`) and keeper logs of jobs that are over. A box's
own disk is unmounted and its cgroup removed with its state dir; box cgroups nothing names
any more are removed once they are old and empty (`CGROUP_GRACE_SECONDS`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from sandbox.backends import backend_class
from sandbox.base import SandboxInfo
from sandbox.cgroups import kill_cgroup, remove_cgroup, sweep_cgroups
from sandbox.procs import process_matches
from sandbox.statedir import (
    TOMBSTONE_PREFIX,
    locked,
    read_info,
    release_state,
    remove_tree,
    state_lock,
)

log = logging.getLogger(__name__)

__all__ = ["GRADING_DIR", "JOB_DATA_DIR", "SandboxInfo", "job_data_dir", "list_sandboxes", "reap"]

GRADING_DIR = ".grading"
"""Where grading boxes live under a state root: fresh boxes a grader starts and stops within
one grade, labelled with the job they grade, apart from the boxes jobs hold."""

JOB_DATA_DIR = ".jobs"
"""Where host data made for one job's boxes lives under a state root (e.g. the repository a
`swe` box clones): `<root>/.jobs/<name>/`, holding a `JOB_FILE` with the job's id. Removed
by the reaper once the job is over; directories being made are `.build-*` beside them."""
JOB_FILE = "job"
KEEPER_LOG_PREFIX = "keeper-"
"""Keeper logs are `<root>/keeper-<job>.log` (`sandbox.keeper`)."""


def job_data_dir(state_root: Path, name: str) -> Path:
    """The data dir of the job named `name` (its id, or a digest of it) under `state_root`."""
    return state_root / JOB_DATA_DIR / name


ORPHAN_GRACE_SECONDS = 300.0
"""A state dir without a readable meta.json is removed once it is this old (a create that
crashed between making the directory and recording it)."""
CGROUP_GRACE_SECONDS = 3600.0
"""A box cgroup of this host that holds no process and that no sandbox under the state root
names is removed once it is this old (a stop or a create that crashed midway)."""


def _state_dirs(state_root: Path) -> list[Path]:
    if not state_root.is_dir():
        return []
    return sorted(p for p in state_root.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_sandboxes(state_root: Path) -> list[SandboxInfo]:
    """Every sandbox recorded under `state_root` (any host), from its meta.json."""
    infos = [read_info(d) for d in _state_dirs(state_root)]
    return [info for info in infos if info is not None]


def why_reap(info: SandboxInfo, job_is_live: Callable[[str], bool], now: float) -> str | None:
    """Why `info`'s sandbox should go, or None if it stays."""
    if now >= info.lease_expires:
        return "its lease expired"
    try:
        live = job_is_live(info.job_id)
    except Exception:
        log.exception("cannot tell whether job %s is live; keeping its sandbox", info.job_id)
        return None
    if not live:
        return f"job {info.job_id} is over"
    if info.pid is not None and not info.halted and not process_matches(info.pid, info.start_time):
        return "its box is gone"
    return None


def reap(
    state_root: Path, job_is_live: Callable[[str], bool], *, now: float | None = None
) -> list[str]:
    """Kill and remove every sandbox of this host under `state_root` (grading boxes in its
    `GRADING_DIR` included) whose job is not live, whose lease expired, or whose box is
    already gone; returns the ids it reaped.

    `job_is_live(job_id)` is asked once per job per sweep; if it raises, that job's
    sandboxes stay. Safe to run concurrently on one host.
    """
    now = time.time() if now is None else now
    host = socket.gethostname()
    verdicts: dict[str, bool] = {}

    def live(job_id: str) -> bool:
        if job_id not in verdicts:
            verdicts[job_id] = job_is_live(job_id)
        return verdicts[job_id]

    roots = (state_root, state_root / GRADING_DIR)
    for root in roots:
        _clear_tombstones(root, now)
    _clear_job_data(state_root, live, now)
    reaped: list[str] = []
    for state_dir in [d for root in roots for d in _state_dirs(root)]:
        info = read_info(state_dir)
        if info is None:
            if _orphaned(state_dir, now):
                with locked(state_lock(state_dir), blocking=False) as held:
                    if held and read_info(state_dir) is None:
                        log.info("removing sandbox dir %s: it was never recorded", state_dir)
                        remove_tree(state_dir)
                        reaped.append(state_dir.name)
            continue
        if info.host != host or why_reap(info, live, now) is None:
            continue
        with locked(state_lock(state_dir), blocking=False) as held:
            current = read_info(state_dir) if held else None
            if current is None:  # another sweep or the owner's stop got there first
                continue
            # Decided again on what the lock holder sees: the box may have been halted for
            # grading (its processes gone on purpose) since the unlocked read.
            reason = why_reap(current, live, now)
            if reason is None:
                continue
            log.info("reaping sandbox %s (job %s): %s", current.id, current.job_id, reason)
            backend_class(current.backend).terminate(current)
            release_state(current)
            reaped.append(current.id)
    known = {d.name for root in roots for d in _state_dirs(root)}
    for name in sweep_cgroups(known, CGROUP_GRACE_SECONDS):
        log.info("removed the cgroup of sandbox %s: its box was gone", name)
    return reaped


def _still_live(job_id: str, live: Callable[[str], bool]) -> bool:
    try:
        return live(job_id)
    except Exception:
        log.exception("cannot tell whether job %s is live; keeping its files", job_id)
        return True


def _clear_job_data(state_root: Path, live: Callable[[str], bool], now: float) -> None:
    """Remove the job data dirs and keeper logs of jobs that are over, and what a crashed
    maker left of a data dir it was making."""
    data = state_root / JOB_DATA_DIR
    entries = sorted(data.iterdir()) if data.is_dir() else []
    for entry in entries:
        try:
            job_id = None if entry.name.startswith(".") else (entry / JOB_FILE).read_text()
        except OSError:
            job_id = None
        if job_id is None:  # being made, or what a crashed maker left
            if _orphaned(entry, now):
                remove_tree(entry)
        elif not _still_live(job_id, live):
            log.info("removing %s: job %s is over", entry, job_id)
            remove_tree(entry)
    if not state_root.is_dir():
        return
    for entry in state_root.glob(f"{KEEPER_LOG_PREFIX}*.log"):
        job_id = entry.name.removeprefix(KEEPER_LOG_PREFIX).removesuffix(".log")
        if not _still_live(job_id, live):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


def _clear_tombstones(state_root: Path, now: float) -> None:
    """Remove what a stop that crashed midway left of a state dir it was removing."""
    if not state_root.is_dir():
        return
    for entry in state_root.iterdir():
        if entry.name.startswith(TOMBSTONE_PREFIX) and _orphaned(entry, now):
            info = read_info(entry)
            if info is not None and info.cgroup:
                kill_cgroup(info.cgroup)
                remove_cgroup(info.cgroup)
            remove_tree(entry)


def _orphaned(state_dir: Path, now: float) -> bool:
    try:
        return now - state_dir.stat().st_mtime > ORPHAN_GRACE_SECONDS
    except OSError:
        return False
