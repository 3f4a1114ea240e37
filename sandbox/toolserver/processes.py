"""Process bookkeeping for the tool server: exit notification, process trees, clean kills.

Linux only (it reads /proc and uses prctl), which is where the sandboxes run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent exits."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Adopt orphaned descendants, so daemons started by tools can still be found and killed."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _read(path: str) -> str | None:
    # os.open/os.read: a third of the system calls of Path.read_text, which matters when
    # walking every process.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def stat(pid: int) -> tuple[str, int, int, int] | None:
    """`(state, ppid, pgid, sid)` of a process, or None if it is gone."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 4:
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/PID/task/*/children, else by scanning /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        raw = _read(f"/proc/{pid}/task/{task}/children")
        if raw is None:
            return _children_by_scan(pid)
        found.extend(int(child) for child in raw.split())
    return found


def _children_by_scan(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = stat(int(name))
            if info is not None and info[1] == pid:
                found.append(int(name))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree, parents before children."""
    found: list[int] = []
    frontier = [pid]
    while frontier:
        for child in children(frontier.pop()):
            found.append(child)
            frontier.append(child)
    return found


def kill_all(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap_adopted(keep: set[int]) -> None:
    """Collect exited children this process did not start itself (adopted as a subreaper).

    Children in `keep` are left alone: their owners wait for them.
    """
    for pid in children(os.getpid()):
        info = stat(pid)
        if pid not in keep and info is not None and info[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def exit_waiter(pid: int) -> asyncio.Future[None]:
    """A future that completes when process `pid` exits (it is not reaped here).

    Uses a pidfd where the kernel has them, else polls.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        poller = loop.create_task(_poll_exit(pid, future))
        future.add_done_callback(lambda _: poller.cancel())
        return future

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not future.done():
            future.set_result(None)

    def on_cancel(_: asyncio.Future[None]) -> None:
        if future.cancelled():
            loop.remove_reader(pidfd)
            os.close(pidfd)

    loop.add_reader(pidfd, on_exit)
    future.add_done_callback(on_cancel)
    return future


async def _poll_exit(pid: int, future: asyncio.Future[None]) -> None:
    while not future.done():
        info = stat(pid)
        if info is None or info[0] in ("Z", "X"):
            future.set_result(None)
            return
        await asyncio.sleep(0.05)
