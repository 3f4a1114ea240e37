"""State directories of sandboxes on the host, and the locks that guard them.

Every sandbox has a state directory `<state_root>/<id>/` holding `meta.json` (its
`SandboxInfo`), the socket directory (the service's; no box writes it), `toolsock.json` (the
identity of the tool server's socket, `SocketIdentity`) and, unless one is given, the
workspace (as root on the box's own tmpfs, `disk/`, with its /tmp and /dev/shm:
`sandbox.boxdisk`), and for a box with a model endpoint, the directory its socket is made in
(`llm/`, `sandbox.endpointdir`). The box that made it, the reaper and any worker on the host may all
reach for it: whoever changes or removes it holds its lock (`locked(state_lock(state_dir))`),
and the uids of boxes under one root are picked under a lock of the root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox import cgroups
from sandbox.base import (
    ALLOW_UNLIMITED_ENV,
    ENDPOINT_DIR,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    env_flag,
)
from sandbox.boxdisk import DISK_DIR, WORKSPACE_DIR, detach, detach_mounts_under, mount_box_disk
from sandbox.cgroups import create_cgroup, kill_cgroup, remove_cgroup

log = logging.getLogger(__name__)


def new_sandbox_id() -> str:
    return secrets.token_hex(6)


def meta_path(state_dir: Path) -> Path:
    return state_dir / "meta.json"


def read_info(state_dir: Path) -> SandboxInfo | None:
    """The sandbox recorded in `state_dir`, or None if there is none (or it is unreadable)."""
    try:
        return SandboxInfo.from_json(meta_path(state_dir).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write_info(info: SandboxInfo) -> None:
    """Record `info` in its state dir atomically (a reader never sees half a file)."""
    target = meta_path(info.state_dir)
    tmp = target.with_name(f".meta.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(info.to_json())
    os.replace(tmp, target)


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path` (created if missing); yields False if `blocking` is
    off and another process holds it, or if its directory is gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def state_lock(state_dir: Path) -> Path:
    return state_dir / ".lock"


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give `path` and everything under it to uid:gid (symlinks themselves, not targets)."""
    os.lchown(path, uid, gid)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(top, name), uid, gid)


def remove_tree(path: Path) -> None:
    """Remove `path` even where the box left directories without write permission. A mount
    below it (a box's own disk) is detached first, not emptied file by file, and the cgroups
    of boxes recorded in it (a state dir or a state root removed whole) go with it."""

    def retry(func: Any, target: str, _exc: Any) -> None:
        parent = os.path.dirname(target)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if path.exists():
        _drop_cgroups(path)
        detach_mounts_under(path)
        shutil.rmtree(path, onerror=retry)


def _drop_cgroups(path: Path) -> None:
    """Kill and remove the cgroups of the boxes recorded at `path` or up to two levels below
    it (a state dir; a state root and its grading root). Only a record in a directory named
    after its sandbox counts: a box may write a meta.json into its own workspace."""
    for meta in (meta_path(path), *path.glob("*/meta.json"), *path.glob("*/*/meta.json")):
        info = read_info(meta.parent)
        if info is None or meta.parent.name != info.id:
            continue
        own = [d for d in info.cgroup or () if os.path.basename(d) == info.id]
        kill_cgroup(own)
        remove_cgroup(own)


REMOVAL_BUDGET_SECONDS = 0.5
"""Longest `discard_tree` removes files itself before it hands the rest to a helper."""


def discard_tree(path: Path, budget: float = REMOVAL_BUDGET_SECONDS) -> None:
    """Remove `path`, spending at most about `budget` seconds on it here: a tree too big for
    that (a workspace of many files on the host's disk) is left to a background `rm`, and
    should that die, to the reaper's sweep of tombstones. Use it on a path nothing else will
    reach (a tombstone)."""
    if not path.exists():
        return
    detach_mounts_under(path)
    deadline = time.monotonic() + budget
    try:
        if _remove_until(path, deadline):
            return
    except OSError:
        if time.monotonic() < deadline:
            remove_tree(path)  # the careful way: permissions the box took away
            return
    try:
        helper = subprocess.Popen(
            ["rm", "-rf", "--one-file-system", "--", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        remove_tree(path)
        return
    threading.Thread(target=helper.wait, name="discard-tree", daemon=True).start()


def _remove_until(top: Path, deadline: float) -> bool:
    """Delete `top` depth first; False as soon as `deadline` (a monotonic time) passes."""
    stack = [str(top)]
    while stack:
        current = stack[-1]
        deeper = None
        with os.scandir(current) as entries:
            for entry in entries:
                if time.monotonic() > deadline:
                    return False
                if entry.is_dir(follow_symlinks=False):
                    deeper = entry.path
                    break
                os.unlink(entry.path)
        if deeper is None:
            os.rmdir(current)
            stack.pop()
        else:
            stack.append(deeper)
    return True


TOMBSTONE_PREFIX = ".gone-"
"""State dirs being removed are renamed to this prefix first."""


def release_state(info: SandboxInfo) -> None:
    """Hand a given workspace back to its owner, remove the box's cgroup and its own disk
    (a lazy unmount, however many files it holds), and remove the state dir.

    Call it holding the state dir's lock, once the box's processes are gone. The dir is
    first renamed out of the way (atomic), so no other process can reach it, or its lock
    file, while it is being removed; what is too big to remove at once is removed in the
    background (`discard_tree`).
    """
    if info.workspace_given and info.workspace_owner is not None and info.workspace.exists():
        with contextlib.suppress(OSError):
            chown_tree(info.workspace, *info.workspace_owner)
    if info.disk is not None:
        try:
            detach(Path(info.disk))
        except OSError as exc:
            log.warning("cannot unmount the disk of sandbox %s: %s", info.id, exc)
    remove_cgroup(info.cgroup)
    tombstone = info.state_dir.with_name(f"{TOMBSTONE_PREFIX}{info.id}-{secrets.token_hex(4)}")
    try:
        os.rename(info.state_dir, tombstone)
    except FileNotFoundError:
        return
    discard_tree(tombstone)


def prepare_state(
    spec: SandboxSpec,
    state_root: Path,
    backend: str,
    *,
    uid_choice: Callable[[set[int]], int] | None = None,
    own_disk: bool = False,
    own_cgroup: bool = False,
) -> SandboxInfo:
    """Create the state dir of a new sandbox (socket dir, workspace) and its meta.json.

    `uid_choice(used)` picks the host uid the box will run as, given the uids of the other
    sandboxes under `state_root`; the pick and the record happen under one lock, so two
    workers never give two boxes the same uid. With `own_disk`, the box gets a tmpfs of its
    own for its workspace, /tmp and /dev/shm under the spec's disk limits, where this host
    allows the mount (`sandbox.boxdisk`; `SandboxInfo.disk` says whether it did). With
    `own_cgroup`, the box gets a cgroup of its own with the spec's box-wide limits, where
    this host has cgroups for boxes (`sandbox.cgroups`; `SandboxInfo.cgroup`).
    """
    state_root = state_root.resolve()
    state_root.mkdir(parents=True, exist_ok=True)
    sandbox_id = new_sandbox_id()
    state_dir = state_root / sandbox_id
    state_dir.mkdir(mode=0o700)
    (state_dir / "sock").mkdir(mode=0o700)
    if spec.endpoint:
        # Boxes see it read-only; only the service writes it (`sandbox.endpointdir`).
        (state_dir / ENDPOINT_DIR).mkdir()
        os.chmod(state_dir / ENDPOINT_DIR, 0o755)
    given = spec.workspace is not None
    workspace = state_dir / "workspace"
    disk = _own_disk(spec, state_dir) if own_disk else None
    if disk is not None and not given:
        workspace = disk / WORKSPACE_DIR
    if spec.workspace is not None:
        workspace = Path(spec.workspace).resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    now = time.time()
    info = SandboxInfo(
        id=sandbox_id,
        job_id=spec.job_id,
        backend=backend,
        host=socket.gethostname(),
        created=now,
        lease_expires=now + spec.lease_seconds,
        state_dir=state_dir,
        workspace=workspace,
        workspace_given=given,
        disk=None if disk is None else str(disk),
    )
    if own_cgroup:
        info.cgroup = _own_cgroup(spec, info)
    if uid_choice is None:
        write_info(info)
        return info
    with locked(state_root / ".uids.lock"):
        used = {other.uid for other in _infos(state_root) if other.uid is not None}
        info.uid = uid_choice(used)
        write_info(info)
    assert info.uid is not None
    if given:
        stat = workspace.stat()
        info.workspace_owner = (stat.st_uid, stat.st_gid)
        write_info(info)
    chown_tree(workspace, info.uid, info.uid)
    # The socket directory stays the service's (mode 0700): the host side makes the socket
    # and passes it to the tool server, so no box ever needs to write there.
    return info


def _own_disk(spec: SandboxSpec, state_dir: Path) -> Path | None:
    """Mount the box's own tmpfs in `state_dir`; None where the spec sets no disk limit or
    this host refuses the mount. SandboxError (the state dir removed) if mounting fails."""
    limits = spec.limits
    if limits.disk_bytes is None and limits.disk_inodes is None:
        return None
    disk = state_dir / DISK_DIR
    given = spec.workspace is not None
    try:
        mounted = mount_box_disk(disk, limits.disk_bytes, limits.disk_inodes, workspace=not given)
    except OSError as exc:
        remove_tree(state_dir)
        raise SandboxError(f"cannot give the box a disk of its own: {exc}") from exc
    if not mounted:
        return None
    if given:
        log.info(
            "the given workspace %s stays on the host's disk, outside the box's disk limit "
            "(only /tmp and /dev/shm are on the box's own tmpfs)",
            spec.workspace,
        )
    return disk


def _own_cgroup(spec: SandboxSpec, info: SandboxInfo) -> list[str] | None:
    """Make the box's cgroup; SandboxError (the state dir removed) if that fails, or if the
    spec has memory or process limits this host cannot hold (`unlimited_refusal`)."""
    limits = spec.limits
    try:
        dirs = create_cgroup(
            info.id,
            memory_bytes=limits.box_memory_bytes,
            pids=limits.box_pids,
            cpu_shares=limits.box_cpu_shares,
        )
    except OSError as exc:
        remove_tree(info.state_dir)
        raise SandboxError(f"cannot make the box's cgroup: {exc}") from exc
    refusal = unlimited_refusal(spec) if dirs is None else None
    if refusal is not None:
        remove_tree(info.state_dir)
        raise SandboxError(refusal)
    return dirs


def unlimited_refusal(spec: SandboxSpec) -> str | None:
    """Why a box of `spec` may not start on this host: it has memory or process limits, this
    host has no cgroups for boxes to hold them, and `ROLLSERVE_SANDBOX_ALLOW_UNLIMITED` is
    not set (None: it may start)."""
    limits = spec.limits
    if limits.box_memory_bytes is None and limits.box_pids is None:
        return None
    host, why = cgroups.host_cgroups()
    if host is not None or env_flag(ALLOW_UNLIMITED_ENV):
        return None
    return (
        f"this host cannot hold a box's memory and process limits ({why}); give the service "
        "cgroups for boxes (root, or a delegated cgroup v2 subtree: the systemd units' "
        f"Delegate=yes), or set {ALLOW_UNLIMITED_ENV}=1 to start boxes without them"
    )


SOCKET_RECORD = "toolsock.json"
"""File in a state dir recording which socket and which process are the box's tool server."""


@dataclass(frozen=True)
class SocketIdentity:
    """What the host recorded when a box's tool server started listening: the socket file
    (device and inode) and the server's peer credentials (host pid and uid)."""

    dev: int
    ino: int
    pid: int
    uid: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SocketIdentity:
        return cls(dev=int(data["dev"]), ino=int(data["ino"]), pid=int(data["pid"]),
                   uid=int(data["uid"]))  # fmt: skip


def write_socket_identity(state_dir: Path, identity: SocketIdentity) -> None:
    """Record `identity` in `state_dir` atomically."""
    target = state_dir / SOCKET_RECORD
    tmp = target.with_name(f".{SOCKET_RECORD}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(identity.as_dict()))
    os.replace(tmp, target)


def read_socket_identity(state_dir: Path) -> SocketIdentity | None:
    """The identity recorded in `state_dir`, or None if there is none (or it is unreadable)."""
    try:
        return SocketIdentity.from_dict(json.loads((state_dir / SOCKET_RECORD).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _infos(state_root: Path) -> Iterator[SandboxInfo]:
    for entry in state_root.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            info = read_info(entry)
            if info is not None:
                yield info


def pick_free_uid(used: set[int], low: int, high: int) -> int:
    """A random uid in [low, high) that is not in `used`."""
    if high - low <= len(used):
        raise SandboxError(f"no free sandbox uid left in [{low}, {high})")
    while True:
        uid = low + secrets.randbelow(high - low)
        if uid not in used:
            return uid
