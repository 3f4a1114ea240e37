"""Limits that hold for a box as a whole: one cgroup per box for memory, processes and CPU
share, and a report of which box-wide limits this host enforces.

rlimits are per process: two processes of one box could each hold the whole memory limit.
A cgroup counts every process of the box together, the main box and every `exec` box, and
the tmpfs pages they write (/tmp, /dev/shm and the box's own disk, `sandbox.boxdisk`).

What the host offers is found once per process (`host_cgroups`):

- **cgroup v1** with `memory` and `pids` hierarchies this process can write (root): the
  box's cgroup is `<hierarchy>/rollserve/<sandbox id>` in each of `memory`, `pids` and,
  when mounted, `cpu`; limits `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`,
  so swap does not widen it), `pids.max`, `cpu.shares`.
- **cgroup v2** with `memory` and `pids` controllers in a subtree this process can write
  (root, or a delegated one): `<subtree>/rollserve/<sandbox id>`, with `memory.max`,
  `memory.swap.max` = 0, `pids.max`, `cpu.weight`. The subtree is the nearest ancestor of
  this process's own cgroup that offers both controllers.
- **neither** (rootless without a delegated subtree): boxes get their rlimits only.

Processes enter the box's cgroup before they can fork: the host command of every box is
prefixed with a tiny `/bin/sh` stub (`enter_argv`) that moves itself into the cgroup (v1:
`tasks`, v2: `cgroup.procs`) and then execs bwrap, so whatever bwrap starts is born inside.
It is a separate process, not a `preexec_fn`, because keepers and workers are multithreaded.

The cgroup's directories are recorded in the sandbox's meta.json (`SandboxInfo.cgroup`);
stopping or reaping the box kills whatever is left in it (`kill_cgroup`) and removes it
(`remove_cgroup`). The counters (`read_counters`) tell an `exec` ended by the box's memory
limit (an OOM kill) or its process limit (a refused fork) from other ends (`box_end`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import shlex
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from sandbox.boxdisk import can_mount, mount_table

log = logging.getLogger(__name__)

PARENT = "rollserve"
"""The cgroup every box's cgroup is made in."""
V1_CONTROLLERS = ("memory", "pids", "cpu")
_REQUIRED = ("memory", "pids")
_STUB_NAME = "rollserve-enter-cgroup"
LIMIT_NAMES = ("memory", "pids", "cpu", "disk", "inodes")


@dataclass(frozen=True)
class HostCgroups:
    """Where this host's box cgroups are made: the `rollserve` parent in each hierarchy."""

    version: int
    parents: tuple[str, ...]
    """v1: one parent per hierarchy (memory, pids, then cpu when mounted); v2: one."""
    cpu: bool
    """The CPU share can be set."""


@dataclass(frozen=True)
class BoxCounters:
    """What a box's cgroup counted so far."""

    oom_kills: int = 0
    """Processes the kernel killed for the box's memory limit."""
    pids_refused: int = 0
    """Forks refused for the box's process limit."""


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as file:
        return file.read()


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as file:
        file.write(value)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller (v1), and under "" its cgroup v2 path."""
    own: dict[str, str] = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _v1_parents() -> tuple[HostCgroups | None, str]:
    mounts: dict[str, str] = {}
    for entry in mount_table():
        if entry.fstype == "cgroup":
            for option in entry.super_options.split(","):
                if option in V1_CONTROLLERS:
                    mounts.setdefault(option, entry.point)
    missing = [c for c in _REQUIRED if c not in mounts]
    if missing:
        return None, f"no cgroup v1 {' or '.join(missing)} hierarchy"
    parents = []
    for controller in V1_CONTROLLERS:
        if controller not in mounts:
            continue
        parent = os.path.join(mounts[controller], PARENT)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            return None, f"cannot make {parent} ({exc.strerror}): cgroup v1 needs root"
        if not os.access(parent, os.W_OK):
            return None, f"{parent} is not writable: cgroup v1 needs root"
        parents.append(parent)
    return HostCgroups(1, tuple(parents), cpu="cpu" in mounts), ""


def _v2_parent() -> tuple[HostCgroups | None, str]:
    mount = next((m.point for m in mount_table() if m.fstype == "cgroup2"), None)
    if mount is None:
        return None, "no cgroup2 mount"
    available = _read(os.path.join(mount, "cgroup.controllers")).split()
    if not all(c in available for c in _REQUIRED):
        return None, f"cgroup v2 at {mount} has no memory or pids controller"
    own = _own_cgroups().get("", "/")
    # The nearest ancestor that lets this process make cgroups and move processes into
    # them: the root as root, or a subtree delegated to this user. Last, this process's own
    # cgroup, when it was delegated (systemd's Delegate=yes): its processes move to a leaf.
    parts = [p for p in own.split("/") if p]
    ancestors = [os.path.join(mount, *parts[:n]) for n in range(max(len(parts) - 1, 0), -1, -1)]
    own_dir = os.path.join(mount, *parts)
    if parts:
        ancestors.append(own_dir)
    why = f"no cgroup v2 subtree above {own} is writable (not root, no delegation)"
    for ancestor in ancestors:
        # Moving a process needs write access to the common ancestor's cgroup.procs too.
        procs = os.path.join(ancestor, "cgroup.procs")
        if not (os.access(ancestor, os.W_OK) and os.access(procs, os.W_OK)):
            continue
        enabled = _read(os.path.join(ancestor, "cgroup.subtree_control")).split()
        try:
            if ancestor == mount and not all(c in enabled for c in _REQUIRED):
                _write(os.path.join(mount, "cgroup.subtree_control"), "+memory +pids")
            elif ancestor == own_dir and not all(c in enabled for c in _REQUIRED):
                _leave_for_leaf(own_dir)
                offered = _read(os.path.join(own_dir, "cgroup.controllers")).split()
                handed = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in offered)
                _write(os.path.join(own_dir, "cgroup.subtree_control"), handed)
            parent = os.path.join(ancestor, PARENT)
            os.makedirs(parent, exist_ok=True)
            offered = _read(os.path.join(parent, "cgroup.controllers")).split()
            wanted = [c for c in ("memory", "pids", "cpu") if c in offered]
            enable = " ".join(f"+{c}" for c in wanted)
            _write(os.path.join(parent, "cgroup.subtree_control"), enable)
        except OSError as exc:
            why = f"cannot set up a cgroup v2 subtree under {ancestor} ({exc.strerror})"
            continue
        if all(c in wanted for c in _REQUIRED):
            return HostCgroups(2, (parent,), cpu="cpu" in wanted), ""
    return None, why


LEAF = "service"
"""The child a delegated cgroup's own processes move to (`_leave_for_leaf`)."""


def _leave_for_leaf(directory: str) -> None:
    """Move every process of the delegated cgroup `directory` into its child `LEAF`: cgroup
    v2 lets only a cgroup that holds no process hand controllers down to its children (the
    boxes' cgroups). Processes forked meanwhile are moved on the next pass."""
    leaf = os.path.join(directory, LEAF)
    os.makedirs(leaf, exist_ok=True)
    for _ in range(10):
        pids = _read(os.path.join(directory, "cgroup.procs")).split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):  # a process that exited meanwhile
                _write(os.path.join(leaf, "cgroup.procs"), pid)


@functools.cache
def host_cgroups() -> tuple[HostCgroups | None, str]:
    """Where box cgroups are made on this host, or (None, why there are none). Found once
    per process; cgroup v1 first (where both are mounted, v2 holds no memory controller)."""
    try:
        found, why_v1 = _v1_parents()
        if found is not None:
            return found, ""
        found, why_v2 = _v2_parent()
    except OSError as exc:
        return None, f"cannot read this host's cgroups: {exc}"
    if found is not None:
        return found, ""
    return None, f"{why_v1}; {why_v2}"


def v2_weight(shares: int) -> int:
    """cgroup v2's `cpu.weight` for v1 `cpu.shares`: in proportion, so that each one's default
    (1024 and 100) stands for the same equal share."""
    return max(1, min(10_000, round(shares * 100 / 1024)))


def create_cgroup(
    sandbox_id: str, *, memory_bytes: int | None, pids: int | None, cpu_shares: int | None
) -> list[str] | None:
    """Make the cgroup of box `sandbox_id` with its limits; its directories, or None where
    this host has no cgroups for boxes. Raises OSError (leaving nothing) when it fails."""
    host, _ = host_cgroups()
    if host is None or (memory_bytes is None and pids is None and cpu_shares is None):
        return None
    dirs = [os.path.join(parent, sandbox_id) for parent in host.parents]
    made: list[str] = []
    try:
        for directory in dirs:
            os.mkdir(directory, 0o755)
            made.append(directory)
            _set_limits(directory, host.version, memory_bytes, pids, cpu_shares)
    except OSError:
        remove_cgroup(made)
        raise
    return dirs


def _set_limits(
    directory: str, version: int, memory_bytes: int | None, pids: int | None, shares: int | None
) -> None:
    def put(name: str, value: object) -> None:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            _write(path, str(value))

    if version == 2:
        if memory_bytes is not None:
            put("memory.max", memory_bytes)
            put("memory.swap.max", 0)
        if pids is not None:
            put("pids.max", pids)
        if shares is not None:
            put("cpu.weight", v2_weight(shares))
        return
    if memory_bytes is not None:
        put("memory.limit_in_bytes", memory_bytes)
        put("memory.memsw.limit_in_bytes", memory_bytes)
    if pids is not None:
        put("pids.max", pids)
    if shares is not None:
        put("cpu.shares", shares)


def enter_argv(dirs: Sequence[str], argv: list[str]) -> list[str]:
    """`argv` run by a stub that first moves itself into the cgroup `dirs` (so everything it
    execs and forks is born there); it fails, running nothing, if it cannot.

    In a cgroup v1 hierarchy the stub (one thread) writes 0, "this thread", to `tasks`: the
    kernel then moves it without the global lock a `cgroup.procs` write takes, which waits
    for an RCU grace period (several milliseconds on every box start). cgroup v2 has only
    `cgroup.procs` for a box's cgroup."""

    def move(directory: str) -> str:
        tasks = os.path.join(directory, "tasks")
        target = tasks if os.path.exists(tasks) else os.path.join(directory, "cgroup.procs")
        return f"echo 0 > {shlex.quote(target)}"

    moves = " && ".join(move(d) for d in dirs)
    return ["/bin/sh", "-c", f'{moves} && exec "$@"', _STUB_NAME, *argv]


def _counter(path: str, key: str) -> int:
    try:
        text = _read(path)
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def read_counters(dirs: Sequence[str] | None) -> BoxCounters:
    """The box's OOM kills and refused forks so far (zeros without a cgroup)."""
    oom = refused = 0
    for directory in dirs or ():
        oom += _counter(os.path.join(directory, "memory.events"), "oom_kill")
        oom += _counter(os.path.join(directory, "memory.oom_control"), "oom_kill")
        refused += _counter(os.path.join(directory, "pids.events"), "max")
    return BoxCounters(oom, refused)


def box_end(
    before: BoxCounters, after: BoxCounters, returncode: int, killed_by: str | None
) -> str | None:
    """`ExecResult.killed_by` for a command that failed while the box's counters moved from
    `before` to `after`: `box_memory` after an OOM kill, `box_pids` after a refused fork;
    else `killed_by` as it was. Another process of the box may have moved them meanwhile,
    so only a command that failed (or ran out of processes) is blamed."""
    if after.oom_kills > before.oom_kills and returncode != 0:
        return "box_memory"
    ran_out = returncode != 0 or killed_by == "processes"
    if after.pids_refused > before.pids_refused and ran_out:
        return "box_pids"
    return killed_by


_BOX_NAME = re.compile(r"[0-9a-f]{12}")


def _box_dirs(dirs: Iterable[str] | None) -> list[str]:
    """The entries of `dirs` that are box cgroups of this host (`<parent>/<sandbox id>`);
    anything else (a record that was tampered with) is left alone."""
    host, _ = host_cgroups()
    found = []
    for directory in dirs or ():
        parent, name = os.path.split(os.path.normpath(directory))
        if host is not None and parent in host.parents and _BOX_NAME.fullmatch(name):
            found.append(directory)
        else:
            log.warning("not a box cgroup, left alone: %s", directory)
    return found


def _members(directory: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(directory, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _in_cgroup(pid: int, directory: str) -> bool:
    name = os.path.basename(directory)
    try:
        lines = _read(f"/proc/{pid}/cgroup").splitlines()
    except OSError:
        return False
    return any(line.rstrip("/").endswith(f"/{PARENT}/{name}") for line in lines)


def kill_cgroup(dirs: Sequence[str] | None, *, wait: float = 5.0) -> None:
    """SIGKILL every process in the box's cgroup and wait (up to `wait` seconds) until none
    is left. Each pid is pinned with a pidfd and checked to still be in the cgroup."""
    dirs = _box_dirs(dirs)
    if not dirs:
        return
    directory = dirs[0]
    kill_file = os.path.join(directory, "cgroup.kill")
    if os.path.exists(kill_file):
        with contextlib.suppress(OSError):
            _write(kill_file, "1")
    deadline = time.monotonic() + wait
    while (pids := _members(directory)) and time.monotonic() < deadline:
        for pid in pids:
            _kill_member(pid, directory)
        time.sleep(0.001)  # killed processes stay listed until they have exited


def kill_if(pid: int, still_ours: Callable[[int], bool]) -> bool:
    """SIGKILL `pid` if `still_ours(pid)` holds once the pid is pinned with a pidfd (so a pid
    reused meanwhile is never hit); True if it was signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if still_ours(pid):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
    except OSError:
        pass
    finally:
        os.close(pidfd)
    return False


def _kill_member(pid: int, directory: str) -> None:
    kill_if(pid, lambda p: _in_cgroup(p, directory))


def remove_cgroup(dirs: Iterable[str] | None, *, wait: float = 2.0) -> None:
    """Remove the box's cgroup directories (they must hold no process: `kill_cgroup`);
    processes that were just killed may hold one busy for a moment."""
    for directory in _box_dirs(dirs):
        deadline = time.monotonic() + wait
        while True:
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("cannot remove the cgroup %s: %s", directory, exc)
                    break
                time.sleep(0.001)


def sweep_cgroups(live_ids: set[str], older_than: float, *, now: float | None = None) -> list[str]:
    """Remove box cgroups of this host that hold no process, are older than `older_than`
    seconds and whose sandbox is not in `live_ids` (a stop that crashed midway); returns
    their names."""
    host, _ = host_cgroups()
    if host is None:
        return []
    now = time.time() if now is None else now
    removed: set[str] = set()
    for parent in host.parents:
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                if not entry.is_dir(follow_symlinks=False) or entry.name in live_ids:
                    continue
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime < older_than or _members(entry.path):
                        continue
                    os.rmdir(entry.path)
                    removed.add(entry.name)
    return sorted(removed)


@dataclass(frozen=True)
class LimitSupport:
    """Whether one box-wide limit holds on this host, and how (or why not)."""

    enforced: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def enforced_limits(backend: str = "bwrap") -> dict[str, LimitSupport]:
    """Which box-wide limits boxes of `backend` get on this host: `memory`, `pids`, `cpu`
    (cgroups), `disk` and `inodes` (the box's own tmpfs), each enforced or not and why."""
    if backend == "local":
        why = "the local backend has no isolation: rlimits per process only"
        return {name: LimitSupport(False, why) for name in LIMIT_NAMES}
    host, why = host_cgroups()
    report: dict[str, LimitSupport] = {}
    if host is None:
        for name in ("memory", "pids", "cpu"):
            report[name] = LimitSupport(False, f"no cgroups for boxes here: {why}")
    else:
        files = {1: ("memory.limit_in_bytes", "pids.max", "cpu.shares"),
                 2: ("memory.max", "pids.max", "cpu.weight")}[host.version]  # fmt: skip
        how = "passed to apptainer for" if backend == "apptainer" else "in"
        where = f"{how} one cgroup per box (cgroup v{host.version}, under {PARENT}/)"
        report["memory"] = LimitSupport(True, f"{files[0]} {where}")
        report["pids"] = LimitSupport(True, f"{files[1]} {where}")
        report["cpu"] = (
            LimitSupport(True, f"{files[2]} {where}")
            if host.cpu
            else LimitSupport(False, "no cpu controller for box cgroups here")
        )
    if backend == "apptainer":
        why_not = "apptainer boxes have no disk of their own: a per-file size cap only"
        report["disk"] = report["inodes"] = LimitSupport(False, why_not)
        return report
    mountable, why_not = can_mount()
    if mountable:
        disk = "one tmpfs per box (size=) holding its workspace, /tmp and /dev/shm"
        report["disk"] = LimitSupport(True, disk)
        report["inodes"] = LimitSupport(True, "one tmpfs per box (nr_inodes=)")
    else:
        why_not += "; a per-file size cap and size-capped /tmp and /dev/shm instead"
        report["disk"] = report["inodes"] = LimitSupport(False, why_not)
    return report
