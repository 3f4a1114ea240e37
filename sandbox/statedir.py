"""State directories of sandboxes on the host, and the locks that guard them.

Every sandbox has a state directory `<state_root>/<id>/` holding `meta.json` (its
`SandboxInfo`), the socket directory (the service's; no box writes it), `toolsock.json` (the
identity of the tool server's socket, `SocketIdentity`) and, unless one is given, the
workspace. The box that made it, the reaper and any worker on the host may all reach for it:
whoever changes or removes it holds its lock (`locked(state_lock(state_dir))`), and the uids
of boxes under one root are picked under a lock of the root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.base import SandboxError, SandboxInfo, SandboxSpec


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
    """Remove `path` even where the box left directories without write permission."""

    def retry(func: Any, target: str, _exc: Any) -> None:
        parent = os.path.dirname(target)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if path.exists():
        shutil.rmtree(path, onerror=retry)


TOMBSTONE_PREFIX = ".gone-"
"""State dirs being removed are renamed to this prefix first."""


def release_state(info: SandboxInfo) -> None:
    """Hand a given workspace back to its owner and remove the state dir.

    Call it holding the state dir's lock. The dir is first renamed out of the way (atomic),
    so no other process can reach it, or its lock file, while it is being removed.
    """
    if info.workspace_given and info.workspace_owner is not None and info.workspace.exists():
        with contextlib.suppress(OSError):
            chown_tree(info.workspace, *info.workspace_owner)
    tombstone = info.state_dir.with_name(f"{TOMBSTONE_PREFIX}{info.id}-{secrets.token_hex(4)}")
    try:
        os.rename(info.state_dir, tombstone)
    except FileNotFoundError:
        return
    remove_tree(tombstone)


def prepare_state(
    spec: SandboxSpec,
    state_root: Path,
    backend: str,
    *,
    uid_choice: Callable[[set[int]], int] | None = None,
) -> SandboxInfo:
    """Create the state dir of a new sandbox (socket dir, workspace) and its meta.json.

    `uid_choice(used)` picks the host uid the box will run as, given the uids of the other
    sandboxes under `state_root`; the pick and the record happen under one lock, so two
    workers never give two boxes the same uid.
    """
    state_root = state_root.resolve()
    state_root.mkdir(parents=True, exist_ok=True)
    sandbox_id = new_sandbox_id()
    state_dir = state_root / sandbox_id
    state_dir.mkdir(mode=0o700)
    (state_dir / "sock").mkdir(mode=0o700)
    given = spec.workspace is not None
    workspace = state_dir / "workspace"
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
    )
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
