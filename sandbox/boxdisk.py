"""A box's own disk: one tmpfs per box on the host, holding its workspace, /tmp and /dev/shm,
so that what the box writes to all three stays under one size and one inode limit.

As root, `mount_box_disk` mounts a tmpfs (`size=`, `nr_inodes=`, nosuid, nodev, mode 0755)
at `<state dir>/disk`, holding `workspace/` (unless the spec gives a workspace: a host
directory cannot live on it), `tmp/` and `shm/` (mode 1777); the box binds `tmp/` at /tmp
and `shm/` at /dev/shm in place of bwrap's own tmpfs. A tmpfs page is charged to the memory
cgroup of whoever writes it, so what the box writes there counts against the box's memory
limit too (keep the disk limit below the memory limit: then a full disk is ENOSPC, not an
OOM kill).

Removing it is a lazy unmount (`detach`): the mount point is free at once, however many
files the tmpfs holds. The kernel frees those files when the last reference goes; for a big
tmpfs that reference is handed to a short-lived helper process, so the caller (a keeper
stopping its box, which a stage waits for) does not pay for it either.

Where this process may not mount (not root, or root without CAP_SYS_ADMIN) boxes keep the
per-file size cap and bwrap's size-capped tmpfs for /tmp and /dev/shm, and the workspace
lives on the host's disk, unbounded as a whole (`can_mount` says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DISK_DIR = "disk"
"""Where a box's own tmpfs is mounted in its state dir."""
WORKSPACE_DIR = "workspace"
TMP_DIR = "tmp"
"""Bound at /tmp in the box."""
SHM_DIR = "shm"
"""Bound at /dev/shm in the box."""
HANDOFF_INODES = 20_000
"""A tmpfs holding more inodes than this is freed by a helper process, not the caller."""

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8
_REFUSED = (errno.EPERM, errno.EACCES)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(target: str, options: str) -> None:
    result = _libc().mount(
        b"rollserve-box", target.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
        options.encode(),
    )  # fmt: skip
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot mount a tmpfs at {target}: {os.strerror(code)}")


def _umount_lazily(target: str) -> bool:
    """Detach the mount at `target`; False if nothing is mounted there."""
    if _libc().umount2(target.encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):
        return False
    raise OSError(code, f"cannot unmount {target}: {os.strerror(code)}")


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo, the parts this package reads."""

    root: str
    """The directory of the file system mounted here (a cgroup hierarchy's subtree)."""
    point: str
    fstype: str
    super_options: str


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as octal escapes.
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def mount_table() -> list[MountEntry]:
    """The mounts this process sees, in mount order."""
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as file:
        for line in file:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            entries.append(MountEntry(_unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2]))
    return entries


@functools.cache
def can_mount() -> tuple[bool, str]:
    """(True, "") when this process can give boxes a tmpfs of their own, else (False, why).
    Probed once per process with a tiny tmpfs in a temporary directory."""
    if os.geteuid() != 0:
        return False, "mounting a tmpfs per box needs root (the service runs unprivileged)"
    probe = tempfile.mkdtemp(prefix="rollserve-mount-probe-")
    try:
        _mount_tmpfs(probe, "size=64k,nr_inodes=16,mode=0700")
    except OSError as exc:
        return False, f"this host refuses to mount a tmpfs per box ({exc.strerror})"
    else:
        _umount_lazily(probe)
        return True, ""
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def mount_box_disk(
    path: Path, size_bytes: int | None, inodes: int | None, *, workspace: bool
) -> bool:
    """Mount a box's own tmpfs at `path` (created) with `tmp/` and `shm/` in it, and
    `workspace/` when `workspace`; False, leaving nothing, where this host refuses mounts.
    Raises OSError for any other failure."""
    options = ["mode=0755"]
    if size_bytes is not None:
        options.append(f"size={size_bytes}")
    if inodes is not None:
        options.append(f"nr_inodes={inodes}")
    path.mkdir(mode=0o755)
    try:
        _mount_tmpfs(str(path), ",".join(options))
    except OSError as exc:
        os.rmdir(path)
        if exc.errno in _REFUSED:
            _say_refused(exc)
            return False
        raise
    try:
        for name in (TMP_DIR, SHM_DIR):
            (path / name).mkdir()
            os.chmod(path / name, 0o1777)
        if workspace:
            (path / WORKSPACE_DIR).mkdir()
    except OSError:
        detach(path)
        raise
    return True


_refusals: set[str] = set()


def _say_refused(exc: OSError) -> None:
    """Log, once per process and reason, that boxes get no disk of their own here."""
    why = exc.strerror or str(exc)
    if why in _refusals:
        return
    _refusals.add(why)
    log.info(
        "this host refuses to mount a tmpfs per box (%s): boxes keep a per-file size cap and "
        "size-capped /tmp and /dev/shm, and their disk limit is not enforced",
        why,
    )


def detach(path: Path) -> bool:
    """Lazily unmount the tmpfs at `path` (instant); one holding many files is freed by a
    helper process. False if nothing was mounted there."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    helper = None
    try:
        used = 0
        with contextlib.suppress(OSError):
            stats = os.fstatvfs(fd)
            used = stats.f_files - stats.f_ffree
        if not _umount_lazily(str(path)):
            return False
        if used > HANDOFF_INODES:
            helper = _holder(fd)
    finally:
        os.close(fd)
    if helper is not None:
        # Ours is closed: the helper's copy is the last reference, and it lets go now.
        assert helper.stdin is not None
        helper.stdin.close()
        threading.Thread(target=helper.wait, name="tmpfs-free", daemon=True).start()
    return True


def _holder(fd: int) -> subprocess.Popen[bytes] | None:
    """A process holding a copy of `fd` until its stdin closes, then exiting."""
    try:
        return subprocess.Popen(
            ["/bin/sh", "-c", "read _"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
            start_new_session=True,
        )
    except OSError:
        return None


def detach_mounts_under(path: Path) -> None:
    """Detach every mount at or below `path` (deepest first), so removing `path` neither
    deletes a tmpfs's files one by one nor fails on a busy mount point."""
    top = os.path.realpath(path)
    prefix = top.rstrip("/") + "/"
    try:
        points = [m.point for m in mount_table() if m.point == top or m.point.startswith(prefix)]
    except OSError:
        return
    for point in sorted(set(points), key=len, reverse=True):
        try:
            detach(Path(point))
        except OSError as exc:
            log.warning("cannot unmount %s: %s", point, exc)
