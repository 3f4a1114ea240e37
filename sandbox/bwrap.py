"""Boxes made with bubblewrap: rootless, namespaced, on the host's kernel.

The box sees a root filesystem read-only (the host's `/`, or a given directory), a writable
`/workspace`, private `/tmp` and `/dev/shm` (tmpfs, capped), fresh `/dev` and `/proc`. Host
directories that hold secrets (`/root`, `/home`, `/run`, and the state root with every other
sandbox's files) are covered with empty tmpfs. All namespaces are unshared (the network's
only when it is off); the box dies with the process that started it.

The tool server's socket is not in the box's filesystem at all: the host binds it in the
state dir's `sock/` (the service's, mode 0700), the box's main process inherits it as a file
descriptor and the tool server listens on it, so nothing in the box can remove, replace or
link the path workers connect through.

Two modes, chosen by who runs the service:

- **as root**: bwrap runs privileged without a user namespace, and the launcher switches to
  a uid of its own for each sandbox (from `uid_range`) before running anything. RLIMIT_NPROC
  is never enforced against uid 0, so only a uid of its own contains a fork bomb; it also
  keeps the box off root-only files (`/etc/shadow`) and root-owned sockets. The workspace is
  given to that uid (and handed back when the sandbox stops).
- **as any other user**: bwrap makes a user namespace per box (`--unshare-user`, and no
  nested ones: `--disable-userns`). RLIMIT_NPROC counts per user namespace, so each box gets
  its own process budget.

bwrap cannot create mount points on a read-only bind, so the root is laid out in bwrap's
tmpfs: each top-level entry of the root is bound on its own, and a directory on the way to a
mount point that does not exist in the root (`/workspace`, the service's Python outside the
root) is rebuilt from its entries the same way.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sandbox.base import (
    WORKSPACE_INSIDE,
    SandboxBackend,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
)
from sandbox.process import ProcessSandbox
from sandbox.startup import host_env, service_paths
from sandbox.statedir import pick_free_uid, prepare_state

DEFAULT_HIDDEN = ("/root", "/home", "/run")
"""Host directories covered with an empty tmpfs in boxes on the host's root."""
DEFAULT_UID_RANGE = (0xB0000000, 0xB0000000 + (1 << 24))
"""Host uids boxes run as when the service runs as root: far above any account or subuid."""

# Top-level entries a box always gets fresh.
_SPECIAL = frozenset({"proc", "dev", "tmp"})
# Covering a hidden directory only needs room for the mount points made in it.
_HIDDEN_TMPFS_BYTES = 1 << 20


@dataclass(frozen=True)
class Mount:
    """One bind into the box: `source` on the host at `inside`."""

    source: str
    inside: str
    writable: bool = False


def _components(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b', '/a/b/c']."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _under(path: str, ancestors: Sequence[str]) -> bool:
    return any(path == a or path.startswith(a.rstrip("/") + "/") for a in ancestors)


def filesystem_args(
    root: str | None,
    mounts: Sequence[Mount],
    *,
    hidden: Sequence[str] = (),
    tmp_bytes: int | None = None,
) -> list[str]:
    """bwrap arguments laying out the box's filesystem.

    `root` is a directory (None: the host's `/`, read-only). `mounts` are binds; their mount
    points need not exist in the root. `hidden` are host paths covered with an empty tmpfs
    wherever the box would see them. On the host's root, a read-only mount of a path onto
    itself is skipped when the path is visible anyway.
    """
    root_dir = os.path.realpath(root or "/")

    def in_root(inside: str) -> str:
        return os.path.join(root_dir, inside.lstrip("/"))

    def fresh(path: str) -> bool:
        return path.split("/")[1] in _SPECIAL

    hidden = sorted({os.path.normpath(h) for h in hidden if os.path.lexists(h)})
    # Paths covered directly (on the host's root, where the box sees host paths as they are).
    cover = []
    if root is None:
        nested = {h for h in hidden if any(o != h and _under(h, [o]) for o in hidden)}
        cover = [h for h in hidden if not fresh(h) and h not in nested]
    top_cover = {h for h in cover if h.count("/") == 1}
    if root is None:
        # A path under /tmp, /dev or /proc is not "visible anyway": the box gets fresh ones.
        mounts = [
            m for m in mounts
            if m.writable or m.inside != m.source or _under(m.inside, cover)
            or fresh(m.inside) or not os.path.exists(m.inside)
        ]  # fmt: skip
    mount_points = {m.inside for m in mounts}

    # Directories rebuilt from their entries (so mount points can be made in them), and
    # directories to create.
    expand: set[str] = set()
    create: list[str] = []
    for m in mounts:
        comps = _components(m.inside)
        covering = [h for h in cover if _under(m.inside, [h]) and h != m.inside]
        if covering:
            create += [c for c in comps[:-1] if _under(c, covering) and c not in covering]
            continue
        for i, comp in enumerate(comps[:-1]):
            if i == 0 and fresh(comp):
                break  # in a fresh tmpfs (/tmp, /dev): bwrap makes the rest
            if not os.path.lexists(in_root(comp)):
                expand.update(comps[:i])
                create += comps[i:-1]
                break
            if os.path.islink(in_root(comp)) or not os.path.isdir(in_root(comp)):
                raise SandboxError(f"cannot mount at {m.inside}: {comp} is not a directory")
        else:
            if not fresh(m.inside) and not os.path.lexists(in_root(m.inside)):
                expand.update(comps[:-1])

    args: list[str] = []

    def layout(directory: str) -> None:
        for name in sorted(os.listdir(in_root(directory))):
            child = os.path.join(directory, name)
            if (directory == "/" and name in _SPECIAL) or child in top_cover:
                continue
            if child in mount_points:
                continue
            source = in_root(child)
            if child in expand:
                # Traversable, so the box reaches the mount point below it.
                mode = stat.S_IMODE(os.lstat(source).st_mode) | 0o111
                args.extend(["--perms", f"{mode:04o}", "--dir", child])
                layout(child)
            elif os.path.islink(source):
                args.extend(["--symlink", os.readlink(source), child])
            else:
                args.extend(["--ro-bind", source, child])

    layout("/")
    args += ["--dev", "/dev", "--proc", "/proc"]
    for path in ("/tmp", "/dev/shm"):
        args += ["--perms", "1777"]
        if tmp_bytes is not None:
            args += ["--size", str(tmp_bytes)]
        args += ["--tmpfs", path]
    for h in cover:
        args += ["--perms", "0755", "--size", str(_HIDDEN_TMPFS_BYTES), "--tmpfs", h]
    made: set[str] = set()
    for directory in create:
        if directory not in made and directory not in expand:
            made.add(directory)
            args += ["--perms", "0755", "--dir", directory]
    for m in mounts:
        args += ["--bind" if m.writable else "--ro-bind", m.source, m.inside]
    # A hidden path a mount brings (back) into view, like the state root under a bound
    # source tree, is covered where it appears, after the mounts.
    covered = set(cover)
    for h in hidden:
        for m in mounts:
            if m.source == h or not _under(h, [m.source]):
                continue
            inside = m.inside.rstrip("/") + h[len(m.source.rstrip("/")) :]
            if inside not in covered:
                covered.add(inside)
                args += ["--perms", "0755", "--size", str(_HIDDEN_TMPFS_BYTES), "--tmpfs", inside]
    return args


def bwrap_argv(
    executable: str,
    *,
    filesystem: list[str],
    env: dict[str, str],
    workdir: str,
    network: bool,
    privileged: bool,
    command: list[str],
) -> list[str]:
    """The bwrap command line for a box (see the module docstring for the two modes)."""
    argv = [executable]
    if privileged:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if not network:
            argv.append("--unshare-net")
        # The launcher needs these two to leave root, and loses them as it does.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
        if network:
            argv.append("--share-net")
    argv += ["--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += filesystem
    argv += ["--chdir", workdir]
    return [*argv, "--", *command]


class BubblewrapSandbox(ProcessSandbox):
    """A sandbox in bubblewrap boxes: one for the tool server, a fresh one per `exec`."""

    def __init__(self, spec: SandboxSpec, info: SandboxInfo, backend: BubblewrapBackend) -> None:
        super().__init__(spec, info)
        self._backend = backend
        state_root = str(info.state_dir.parent)
        self._filesystem = filesystem_args(
            spec.root,
            self._mounts(),
            hidden=[*backend.hidden, state_root] if spec.root is None else [state_root],
            tmp_bytes=spec.limits.memory_bytes,
        )

    def _mounts(self) -> list[Mount]:
        mounts = [Mount(str(path), str(path)) for path in service_paths()]
        if self.spec.network:
            resolv = os.path.realpath("/etc/resolv.conf")
            if os.path.exists(resolv):
                inside = resolv if self.spec.root is None else "/etc/resolv.conf"
                mounts.append(Mount(resolv, inside))
        for bind in self.spec.binds:
            mounts.append(Mount(str(Path(bind.host).resolve()), bind.inside, not bind.read_only))
        mounts.append(Mount(str(self.workspace), WORKSPACE_INSIDE, writable=True))
        return mounts

    def _passes_socket_fd(self) -> bool:
        return True

    def _host_process(
        self, command: list[str], env: dict[str, str], ready_fd: int | None
    ) -> tuple[list[str], dict[str, str]]:
        argv = bwrap_argv(
            self._backend.executable,
            filesystem=self._filesystem,
            env=env,
            workdir=self.spec.workdir,
            network=self.spec.network,
            privileged=self._backend.privileged,
            command=command,
        )
        return argv, host_env(self.id, self.job_id)


class BubblewrapBackend(SandboxBackend):
    """Boxes made with bubblewrap (see the module docstring)."""

    name: ClassVar[str] = "bwrap"

    def __init__(
        self,
        *,
        executable: str | None = None,
        hidden: Sequence[str] = DEFAULT_HIDDEN,
        uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
    ) -> None:
        self.executable = executable or shutil.which("bwrap") or "bwrap"
        self.hidden = tuple(hidden)
        self.uid_range = uid_range
        self.privileged = os.geteuid() == 0

    @functools.cache  # noqa: B019 - one answer per backend object is the point
    def available(self) -> tuple[bool, str]:
        if shutil.which(self.executable) is None:
            return False, "bubblewrap is not installed (apt-get install bubblewrap)"
        namespaces = ["--unshare-pid", "--unshare-net"] if self.privileged else [
            "--unshare-all", "--unshare-user"
        ]  # fmt: skip
        probe = [self.executable, "--ro-bind", "/", "/", *namespaces, "true"]
        try:
            result = subprocess.run(probe, capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"bubblewrap does not run: {exc}"
        if result.returncode != 0:
            why = result.stderr.decode(errors="replace").strip()
            return False, f"bubblewrap cannot make a box here (user namespaces off?): {why}"
        return True, ""

    def create(self, spec: SandboxSpec, state_root: Path) -> BubblewrapSandbox:
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        if spec.root is not None and not os.path.isdir(spec.root):
            raise SandboxError(f"the root filesystem {spec.root} is not a directory")
        low, high = self.uid_range
        choose = (lambda used: pick_free_uid(used, low, high)) if self.privileged else None
        info = prepare_state(spec, state_root, self.name, uid_choice=choose)
        return BubblewrapSandbox(spec, info, self)
