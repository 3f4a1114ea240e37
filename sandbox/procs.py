"""Host processes of sandboxes: the labels they carry, and finding, checking and killing them.

Every process the service starts for a box carries the labels `ROLLSERVE_SANDBOX_ID` and
`ROLLSERVE_SANDBOX_JOB` in its environment, so the reaper can find and kill what a crashed
worker left behind. Everything here reads `/proc` and sends signals, nothing more; it needs
no sandbox object, so workers can use it to check on their own processes too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.cgroups import kill_cgroup, kill_if

if TYPE_CHECKING:
    from sandbox.base import SandboxInfo

LABEL_ID = "ROLLSERVE_SANDBOX_ID"
"""Environment label naming the sandbox a process belongs to."""
LABEL_JOB = "ROLLSERVE_SANDBOX_JOB"
"""Environment label naming the job of the sandbox a process belongs to."""


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks after boot, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields resume after the last ")".
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def process_matches(pid: int | None, start_time: int | None) -> bool:
    """True while `pid` runs and is the process that started at `start_time`."""
    if pid is None:
        return False
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in environ.split(b"\0")


def labelled_pids(sandbox_id: str) -> list[int]:
    """Pids of live processes labelled as belonging to `sandbox_id`."""
    needle = f"{LABEL_ID}={sandbox_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _environ_has(int(name), needle):
            found.append(int(name))
    return found


def kill_labelled(sandbox_id: str) -> int:
    """SIGKILL every process labelled with `sandbox_id`; returns how many were signalled.

    Each pid is pinned with a pidfd and its label checked again through it, so a pid reused
    between the scan and the kill is never hit.
    """
    needle = f"{LABEL_ID}={sandbox_id}".encode()
    return sum(
        kill_if(pid, lambda p: _environ_has(p, needle))
        for pid in labelled_pids(sandbox_id)
        if pid != os.getpid()
    )


def kill_group(pgid: int | None) -> None:
    """SIGKILL a process group, if it still exists."""
    if pgid is None or pgid <= 1:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def kill_box_processes(info: SandboxInfo, *, wait: float = 5.0) -> None:
    """Kill the box's main process group, every labelled process and whatever is left in
    its cgroup; wait until none is left."""
    if process_matches(info.pid, info.start_time):
        kill_group(info.pgid)
    deadline = time.monotonic() + wait
    while kill_labelled(info.id) and time.monotonic() < deadline:
        time.sleep(0.005)
    kill_cgroup(info.cgroup, wait=max(0.0, deadline - time.monotonic()))


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Traces an exhausted limit leaves on stderr (bash, coreutils, Python, glibc, C++).
_LIMIT_TRACES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("processes", ("fork: retry", "fork: resource temporarily unavailable", "cannot fork",
                   "can't fork", "can't start new thread", "blockingioerror: [errno 11]")),
    ("memory_bytes", ("memoryerror", "cannot allocate memory", "bad_alloc", "out of memory",
                      "memory exhausted")),
    ("file_size_bytes", ("file too large",)),
    ("disk_bytes", ("no space left on device", "disk quota exceeded")),
    ("cpu_seconds", ("cpu time limit exceeded",)),
)  # fmt: skip
# bash's own words for a failed fork: specific enough to report even when the command exits
# 0 (a fork bomb's first shell returns at once; the box's end kills the rest).
_FORK_FAILURES = ("fork: retry", "fork: resource temporarily unavailable")
_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu_seconds", signal.SIGXFSZ: "file_size_bytes"}


def exit_signal(returncode: int) -> int | None:
    """The signal that ended a command: Popen's negative code, or a shell's (or bwrap's) 128+n."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + 65:
        return returncode - 128
    return None


def explain_end(returncode: int, stderr: str, timed_out: bool) -> str | None:
    """`ExecResult.killed_by` for a command that ended this way (see ExecResult)."""
    sig = exit_signal(returncode)
    if sig in _SIGNAL_LIMITS:
        return _SIGNAL_LIMITS[signal.Signals(sig)]
    lowered = stderr.lower()
    if returncode != 0 or timed_out:
        for limit, traces in _LIMIT_TRACES:
            if any(trace in lowered for trace in traces):
                return limit
    elif any(trace in lowered for trace in _FORK_FAILURES):
        return "processes"
    return None if sig is None else signal_name(sig)
