"""Boxes made with bubblewrap: rootless, namespaced, on the host's kernel.

The box sees a root filesystem read-only (a given directory whole, or of the host's `/` only
`MINIMAL_ROOT`, the service's Python and the backend's extra paths), a writable
`/workspace`, private `/tmp` and `/dev/shm` (tmpfs, capped), fresh `/dev` and `/proc`.
The state root, with every other sandbox's files, is covered with an empty tmpfs wherever a
bind would show it, and so are `hidden` host directories (`/root`, `/home`, `/run`) wherever
the box would see them. All namespaces are unshared; a box with network (as root only) runs
in its sandbox's own network namespace, behind the egress proxy (`sandbox.network`), never in
the host's. The box dies with the process that started it.

A box with a model endpoint sees its own sandbox's endpoint directory read-only at
`/rollserve/llm` (`sandbox.endpointdir`), and no other part of the state root.

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

Limits for the box as a whole: every box (the main one and each `exec`) is started inside the
sandbox's cgroup (`sandbox.cgroups`) where the host has cgroups for boxes; as root, the
workspace, /tmp and /dev/shm live on one tmpfs of the sandbox's own (`sandbox.boxdisk`),
bound in place of bwrap's size-capped tmpfs.

bwrap cannot create mount points on a read-only bind, so the root is laid out in bwrap's
tmpfs: each top-level entry of the root the box sees is bound on its own (a symlink is made as
a symlink), a directory the box sees only part of (the host's `/etc`) is made with just those
parts, a directory on the way to a mount point that does not exist in the root (`/workspace`,
the service's Python outside the root) is rebuilt from its entries the same way, and one the
box does not see at all (`/root` above a pyenv Python) is made empty.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import stat
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from core.egress import EgressRuleError, HostRule, parse_rule
from core.settings import parse_networks
from sandbox.base import (
    ENDPOINT_DIR,
    ENDPOINT_DIR_INSIDE,
    WORKSPACE_INSIDE,
    SandboxBackend,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
)
from sandbox.boxdisk import SHM_DIR, TMP_DIR
from sandbox.egress import PRIVATE_SETTING, Network
from sandbox.network import BoxNetwork, missing, nsenter_argv, resolv_conf
from sandbox.process import ProcessSandbox
from sandbox.procs import LABEL_ID
from sandbox.startup import host_env, service_paths
from sandbox.statedir import pick_free_uid, prepare_state, release_state

MINIMAL_ROOT: tuple[str, ...] = (
    # Programs and libraries; on a merged-/usr host the top-level ones are symlinks into /usr.
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    # Users and groups (names in `ls -l` and `ps`), name service, the dynamic linker.
    "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf",
    "/etc/gai.conf", "/etc/protocols", "/etc/services",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
    # Time zone, TLS (Python's ssl, git, pip and curl read /etc/ssl), the system's name.
    "/etc/localtime", "/etc/timezone", "/etc/ssl/certs", "/etc/ssl/openssl.cnf",
    "/etc/os-release", "/etc/lsb-release", "/etc/debian_version",
    # Where /usr links to: alternatives (awk, editor, pager, java), the JDK's configuration.
    "/etc/alternatives", "/etc/java-*",
    # Shells and terminals.
    "/etc/shells", "/etc/profile", "/etc/profile.d", "/etc/bash.bashrc", "/etc/environment",
    "/etc/inputrc", "/etc/terminfo", "/etc/mtab",
    # Tools' own system-wide settings: git, pip, Python, Perl, file types.
    "/etc/gitconfig", "/etc/pip.conf", "/etc/xdg/pip", "/etc/python3*", "/etc/perl",
    "/etc/mime.types", "/etc/magic", "/etc/magic.mime",
)  # fmt: skip
"""What a box on the host's root sees of it, read-only: the system's programs and libraries,
and the files under /etc that bash, coreutils, procps, grep, sed, awk, git, Python, pip and
Perl read (users and groups, name service, dynamic linker, time zone, certificates, shell
start-up, their own settings). Shell-style patterns are expanded; paths the host lacks are
left out; symlinks stay symlinks (`/bin` on a merged-/usr host).

Nothing else of the host is there: not /etc as a whole (service configurations, keys,
`resolv.conf`, which only boxes with the network get), /var, /srv, /opt, /mnt, /media, /home,
/root, /run, /sys, the data directories, the project's checkout, the state root. The service's
Python (`service_paths()`) is bound on its own; a backend adds `extra_paths`."""
DEFAULT_HIDDEN = ("/root", "/home", "/run")
"""Host directories covered with an empty tmpfs wherever a box would see them: on the host's
root only under an exposed path (with `MINIMAL_ROOT` alone, nowhere), and in a root of its
own (an image directory) wherever that root holds them."""
EXTRA_PATHS_ENV = "ROLLSERVE_SANDBOX_EXTRA_PATHS"
"""Environment variable naming more host paths boxes on the host's root see read-only
(separated by `,` or `:`): the default of `BubblewrapBackend(extra_paths=...)`."""
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


def _exposed(root_dir: str, expose: Sequence[str] | None) -> list[str]:
    """The paths of `expose` (shell-style patterns expanded) that the root holds, as the box
    names them; `["/"]` for None (the whole root)."""
    if expose is None:
        return ["/"]
    found: set[str] = set()
    for entry in expose:
        pattern = os.path.join(root_dir, os.path.normpath(entry).lstrip("/"))
        for match in glob.glob(pattern) if glob.has_magic(pattern) else [pattern]:
            if os.path.lexists(match):
                inside = os.path.relpath(match, root_dir)
                found.add("/" if inside == "." else "/" + inside)
    return sorted(found)


class _View:
    """Which paths of the root the box sees: those under an exposed path whole, and the
    directories on the way to one only in part (the exposed entries below them)."""

    def __init__(self, root_dir: str, expose: Sequence[str] | None) -> None:
        self.root_dir = root_dir
        self.exposed = _exposed(root_dir, expose)
        self._exposed = set(self.exposed)
        self._on_the_way = {"/", *(c for e in self.exposed for c in _components(e)[:-1])}

    def in_root(self, inside: str) -> str:
        return os.path.join(self.root_dir, inside.lstrip("/"))

    def whole(self, path: str) -> bool:
        return "/" in self._exposed or any(c in self._exposed for c in _components(path))

    def partial(self, path: str) -> bool:
        return path in self._on_the_way and not self.whole(path)

    def shows(self, path: str) -> bool:
        """True if the box has `path` (the root's, or a directory made on the way to one)."""
        seen = self.whole(path) or self.partial(path)
        return seen and os.path.lexists(self.in_root(path))


def filesystem_args(
    root: str | None,
    mounts: Sequence[Mount],
    *,
    expose: Sequence[str] | None = None,
    hidden: Sequence[str] = (),
    tmp_bytes: int | None = None,
) -> list[str]:
    """bwrap arguments laying out the box's filesystem.

    `root` is a directory (None: the host's `/`), read-only. `expose` names the paths of the
    root the box sees (None: all of it); shell-style patterns are expanded, paths the root
    lacks are left out, and the directories on the way to an exposed path hold only what is
    exposed (or mounted) in them. `mounts` are binds; their mount points need not exist in
    the root. `hidden` are host paths covered with an empty tmpfs wherever the box would see
    them whole, whatever the root (a root that is, or holds, a hidden path shows it covered).
    On the host's root, a read-only mount of a path onto itself is skipped when the path is
    visible anyway.

    The layout is made in steps, each of which can be checked on its own: the binds of the
    exposed paths under the fresh /tmp, /dev and /proc (`_with_exposed_fresh`), the hidden
    paths to cover (`hidden_covers`), the binds worth making (`_needed_mounts`), the
    directories to rebuild or make for mount points (`_mount_point_dirs`), then the
    arguments: the root (`_root_args`), the fresh directories (`_fresh_args`), the covers,
    the directories made, the binds (`_mount_args`), and the covers of hidden paths a bind
    brings back into view (`_covers_in_mounts`).
    """
    view = _View(os.path.realpath(root or "/"), expose)
    mounts = _with_exposed_fresh(view, mounts)
    hidden = sorted({os.path.normpath(h) for h in hidden if os.path.lexists(h)})
    cover = hidden_covers(view, hidden)
    if root is None:
        mounts = _needed_mounts(view, mounts, cover)
    expand, create = _mount_point_dirs(view, mounts, cover)
    mount_points = {m.inside for m in mounts}
    args = _root_args(view, cover, mount_points, expand)
    args += _fresh_args(mount_points, tmp_bytes)
    args += _cover_args(cover)
    made: set[str] = set()
    for directory in create:
        if directory not in made and directory not in expand:
            made.add(directory)
            args += ["--perms", "0755", "--dir", directory]
    args += _mount_args(mounts, mount_points, made)
    args += _cover_args(_covers_in_mounts(hidden, mounts, set(cover)))
    return args


def _fresh(path: str) -> bool:
    """True for a path under /tmp, /dev or /proc, which every box gets fresh."""
    return path.split("/")[1] in _SPECIAL


def _with_exposed_fresh(view: _View, mounts: Sequence[Mount]) -> list[Mount]:
    """`mounts`, and a bind of each exposed path under /tmp, /dev or /proc: the box gets those
    fresh, so what it is to see in them is bound onto them, last."""
    fresh = [e for e in view.exposed if e != "/" and _fresh(e)]
    return [*mounts, *(Mount(view.in_root(e), e) for e in fresh)]


def hidden_covers(view: _View, hidden: Sequence[str]) -> list[str]:
    """Where, inside the box, the hidden host paths are to be covered with an empty tmpfs:
    each one the root holds (the host's root: as it is; another root: where it lies in it)
    and the box sees whole, outermost only, never under the fresh /tmp, /dev or /proc."""
    inside = sorted({p for p in (_inside_root(view.root_dir, h) for h in hidden) if p})
    nested = {h for h in inside if any(o != h and _under(h, [o]) for o in inside)}
    return [h for h in inside if h not in nested and not _fresh(h) and view.whole(h)]


def _inside_root(root_dir: str, host_path: str) -> str | None:
    """Where the box on `root_dir` sees `host_path` (None: the root does not hold it)."""
    if root_dir == "/":
        return host_path
    real = os.path.realpath(host_path)
    if not _under(real, [root_dir]) or real == root_dir:
        return None
    return "/" + os.path.relpath(real, root_dir)


def _needed_mounts(view: _View, mounts: Sequence[Mount], cover: Sequence[str]) -> list[Mount]:
    """On the host's root, the mounts worth making: a read-only bind of a path onto itself
    is left out when the box sees the path anyway (not covered, not under a fresh
    directory)."""
    return [
        m for m in mounts
        if m.writable or m.inside != m.source or _under(m.inside, cover)
        or _fresh(m.inside) or not os.path.exists(m.inside) or not view.whole(m.inside)
    ]  # fmt: skip


def _mount_point_dirs(
    view: _View, mounts: Sequence[Mount], cover: Sequence[str]
) -> tuple[set[str], list[str]]:
    """(directories rebuilt from their entries, directories to make) so every mount point
    exists: bwrap cannot make one on a read-only bind. SandboxError for a mount point under
    a symlink or a file."""
    expand: set[str] = set()
    create: list[str] = []
    for m in mounts:
        comps = _components(m.inside)
        covering = [h for h in cover if _under(m.inside, [h]) and h != m.inside]
        if covering:
            create += [c for c in comps[:-1] if _under(c, covering) and c not in covering]
            continue
        for i, comp in enumerate(comps[:-1]):
            if i == 0 and _fresh(comp):
                break  # in a fresh tmpfs (/tmp, /dev): bwrap makes the rest
            if not view.shows(comp):
                expand.update(comps[:i])
                create += comps[i:-1]
                break
            source = view.in_root(comp)
            if os.path.islink(source) or not os.path.isdir(source):
                raise SandboxError(f"cannot mount at {m.inside}: {comp} is not a directory")
        else:
            if not _fresh(m.inside) and not view.shows(m.inside):
                expand.update(comps[:-1])
    return expand, create


def _root_args(
    view: _View, cover: Sequence[str], mount_points: set[str], expand: set[str]
) -> list[str]:
    """The root the box sees, laid out in bwrap's tmpfs: each entry it shows bound on its own
    (a symlink made as one), a directory it shows in part or that a mount point needs
    rebuilt from its entries; covered paths, mount points and /proc, /dev, /tmp left out."""
    args: list[str] = []

    def layout(directory: str) -> None:
        for name in sorted(os.listdir(view.in_root(directory))):
            child = os.path.join(directory, name)
            if (directory == "/" and name in _SPECIAL) or child in cover:
                continue
            if child in mount_points or not view.shows(child):
                continue
            source = view.in_root(child)
            if child in expand or (view.partial(child) and not os.path.islink(source)):
                # Traversable, so the box reaches what is exposed or mounted below it.
                mode = stat.S_IMODE(os.lstat(source).st_mode) | 0o111
                args.extend(["--perms", f"{mode:04o}", "--dir", child])
                layout(child)
            elif os.path.islink(source):
                args.extend(["--symlink", os.readlink(source), child])
            else:
                args.extend(["--ro-bind", source, child])

    layout("/")
    return args


def _fresh_args(mount_points: set[str], tmp_bytes: int | None) -> list[str]:
    """Fresh /dev and /proc, and /tmp and /dev/shm (size-capped tmpfs) unless the box's own
    disk is bound there."""
    args = ["--dev", "/dev", "--proc", "/proc"]
    for path in ("/tmp", "/dev/shm"):
        if path in mount_points:
            continue  # the box's own disk, bound below
        args += ["--perms", "1777"]
        if tmp_bytes is not None:
            args += ["--size", str(tmp_bytes)]
        args += ["--tmpfs", path]
    return args


def _cover_args(cover: Sequence[str]) -> list[str]:
    args: list[str] = []
    for path in cover:
        args += ["--perms", "0755", "--size", str(_HIDDEN_TMPFS_BYTES), "--tmpfs", path]
    return args


def _mount_args(mounts: Sequence[Mount], mount_points: set[str], made: set[str]) -> list[str]:
    """The binds, outer mount points first: a bind under another one (the service's Python in
    a checkout under /tmp, below the box's own /tmp) must come after it, or it is covered. In
    a fresh /tmp or /dev the directories on the way to a mount point are made traversable
    first (bwrap would make them with the keeper's umask, out of the box user's reach)."""
    args: list[str] = []
    for m in sorted(mounts, key=lambda m: len(_components(m.inside))):
        if _fresh(m.inside):
            for directory in _components(m.inside)[1:-1]:
                if directory not in made and directory not in mount_points:
                    made.add(directory)
                    args += ["--perms", "0755", "--dir", directory]
        args += ["--bind" if m.writable else "--ro-bind", m.source, m.inside]
    return args


def _covers_in_mounts(
    hidden: Sequence[str], mounts: Sequence[Mount], covered: set[str]
) -> list[str]:
    """Where a bind brings a hidden path (back) into view, like the state root under a bound
    source tree: covered there, after the binds."""
    found: list[str] = []
    for h in hidden:
        for m in mounts:
            if m.source == h or not _under(h, [m.source]):
                continue
            inside = m.inside.rstrip("/") + h[len(m.source.rstrip("/")) :]
            if inside not in covered:
                covered.add(inside)
                found.append(inside)
    return found


def service_dirs() -> list[str]:
    """The service's data directory (`ROLLSERVE_DATA_DIR`, its results and Redis data
    within), hidden from every box like the state root."""
    return [os.path.realpath(os.environ.get("ROLLSERVE_DATA_DIR") or ".rollserve")]


def env_extra_paths() -> list[str]:
    """The host paths `ROLLSERVE_SANDBOX_EXTRA_PATHS` names (separated by `,` or `:`)."""
    value = os.environ.get(EXTRA_PATHS_ENV, "")
    return [part.strip() for part in re.split(r"[,:]", value) if part.strip()]


def bwrap_argv(
    executable: str,
    *,
    filesystem: list[str],
    env: dict[str, str],
    workdir: str,
    netns: str | None = None,
    privileged: bool,
    command: list[str],
) -> list[str]:
    """The bwrap command line for a box (see the module docstring for the two modes).

    `netns` is the sandbox's own network namespace (`sandbox.network`), which bwrap then runs
    in; without it the box gets a fresh one with loopback alone. Never the host's.
    """
    if netns is not None and not privileged:
        raise SandboxError("a box joins a network namespace of its own only as root")
    argv = [executable] if netns is None else [*nsenter_argv(netns), executable]
    if privileged:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if netns is None:
            argv.append("--unshare-net")
        # The launcher needs these two to leave root, and loses them as it does.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    argv += ["--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += filesystem
    argv += ["--chdir", workdir]
    return [*argv, "--", *command]


def disk_mounts(info: SandboxInfo) -> list[Mount]:
    """/tmp and /dev/shm from the box's own disk, when it has one (`sandbox.boxdisk`)."""
    if info.disk is None:
        return []
    disk = Path(info.disk)
    return [Mount(str(disk / TMP_DIR), "/tmp", True), Mount(str(disk / SHM_DIR), "/dev/shm", True)]


def egress_rules(spec: SandboxSpec) -> tuple[HostRule, ...]:
    """The hosts a box of `spec` may connect to (host names, `*.domain` patterns, each with
    an optional port); SandboxError for one it cannot read."""
    if spec.egress and not spec.network:
        raise SandboxError("egress rules need a box with network")
    try:
        return tuple(parse_rule(text, patterns=True) for text in spec.egress)
    except EgressRuleError as exc:
        raise SandboxError(f"egress: {exc}") from None


class BubblewrapSandbox(ProcessSandbox):
    """A sandbox in bubblewrap boxes: one for the tool server, a fresh one per `exec`."""

    def __init__(self, spec: SandboxSpec, info: SandboxInfo, backend: BubblewrapBackend) -> None:
        super().__init__(spec, info)
        self._backend = backend
        self._egress_rules = egress_rules(spec)
        self._network: BoxNetwork | None = None
        self._network_closed = False
        self._network_lock = threading.Lock()
        state_root = str(info.state_dir.parent)
        self._filesystem = filesystem_args(
            spec.root,
            [*self._mounts(), *disk_mounts(info)],
            expose=backend.root_paths if spec.root is None else None,
            # Whatever the root: an image root that holds host paths shows them covered.
            hidden=[*backend.hidden, *service_dirs(), state_root],
            tmp_bytes=spec.limits.disk_bytes or spec.limits.memory_bytes,
        )

    def _mounts(self) -> list[Mount]:
        mounts = [Mount(str(path), str(path)) for path in service_paths()]
        if self.spec.network:
            # Its name server is the egress proxy's resolver (the host's is out of reach).
            resolv = self.state_dir / "resolv.conf"
            resolv.write_text(resolv_conf())
            mounts.append(Mount(str(resolv), "/etc/resolv.conf"))
        for bind in self.spec.binds:
            mounts.append(Mount(str(Path(bind.host).resolve()), bind.inside, not bind.read_only))
        mounts.append(Mount(str(self.workspace), WORKSPACE_INSIDE, writable=True))
        if self.spec.endpoint:
            # Only its own: the state root stays covered (`sandbox.endpointdir`).
            mounts.append(Mount(str(self.state_dir / ENDPOINT_DIR), ENDPOINT_DIR_INSIDE))
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
            netns=self._network_namespace(),
            privileged=self._backend.privileged,
            command=command,
        )
        return argv, host_env(self.id, self.job_id)

    def _network_namespace(self) -> str | None:
        """The path of the sandbox's network namespace, made on first use (None without
        network: each box then gets a fresh one with loopback alone)."""
        if not self.spec.network:
            return None
        with self._network_lock:
            if self._network_closed:
                raise SandboxError(f"sandbox {self.id} was stopped")
            if self._network is None:
                # slirp4netns carries the job's label but not the sandbox's: a halt, which
                # kills what carries the sandbox's, must not take its interface (and the
                # routes to the proxy's resolver) from the commands that follow. It ends
                # with this process through its exit pipe.
                env = host_env(self.id, self.job_id)
                del env[LABEL_ID]
                self._network = BoxNetwork.start(
                    self.state_dir, self._egress_rules, env, self._backend.egress_networks
                )
            return self._network.netns_path

    @property
    def network(self) -> BoxNetwork | None:
        """The sandbox's network, once a box with network has started."""
        return self._network

    def halt(self) -> None:
        # The agent's turns are over: nothing the box runs from now on reaches outside.
        with self._network_lock:
            network = self._network
        if network is not None:
            network.close_egress("the agent's turns are over")
        super().halt()

    def stop(self) -> None:
        with self._network_lock:
            self._network_closed = True
            network, self._network = self._network, None
        try:
            super().stop()
        finally:
            if network is not None:
                network.close()


PROBE_PATHS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32")
"""What the availability probe's box sees: enough to run `true`."""


class BubblewrapBackend(SandboxBackend):
    """Boxes made with bubblewrap (see the module docstring)."""

    name: ClassVar[str] = "bwrap"

    def __init__(
        self,
        *,
        executable: str | None = None,
        extra_paths: Sequence[str] | None = None,
        hidden: Sequence[str] = DEFAULT_HIDDEN,
        uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
        egress_networks: Sequence[Network] | None = None,
    ) -> None:
        """`extra_paths` are host paths boxes on the host's root see read-only besides
        `MINIMAL_ROOT` (None: those `ROLLSERVE_SANDBOX_EXTRA_PATHS` names); `hidden` are
        covered with an empty tmpfs wherever such a box would see them; `egress_networks`
        are the private networks an allowed host of a box with network may resolve into
        (None: those `ROLLSERVE_SANDBOX_EGRESS_NETWORKS` names; none by default)."""
        self.executable = executable or shutil.which("bwrap") or "bwrap"
        extras = env_extra_paths() if extra_paths is None else list(extra_paths)
        for path in extras:
            if not os.path.isabs(path):
                raise ValueError(f"an extra path for boxes must be absolute: {path!r}")
        # A symlink is exposed as one, so what it points to is exposed too.
        resolved = [os.path.realpath(p) for p in extras]
        # What boxes on the host's root see of it (`filesystem_args(expose=...)`).
        self.root_paths = tuple(dict.fromkeys([*MINIMAL_ROOT, *extras, *resolved]))
        self.hidden = tuple(hidden)
        self.uid_range = uid_range
        if egress_networks is None:
            egress_networks = parse_networks(os.environ.get(PRIVATE_SETTING))
        self.egress_networks = tuple(egress_networks)
        self.privileged = os.geteuid() == 0

    @functools.cache  # noqa: B019 - one answer per backend object is the point
    def available(self) -> tuple[bool, str]:
        """Whether this host can make boxes, by making one that runs `true` (asked once per
        backend object)."""
        if shutil.which(self.executable) is None:
            return False, "bubblewrap is not installed (apt-get install bubblewrap)"
        namespaces = ["--unshare-pid", "--unshare-net"] if self.privileged else [
            "--unshare-all", "--unshare-user"
        ]  # fmt: skip
        # Only the programs and libraries, not the host's whole tree: binding `/` takes every
        # mount under it along, and one that goes away meanwhile (another box's disk, a
        # network namespace) fails the bind.
        binds = [arg for path in PROBE_PATHS for arg in ("--ro-bind-try", path, path)]
        probe = [self.executable, *binds, *namespaces, "true"]
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
        if spec.network and (lacking := missing(self.privileged)):
            raise SandboxError(
                "a box with network gets a network namespace of its own behind the egress "
                f"proxy, and this host lacks {', '.join(lacking)}"
            )
        egress_rules(spec)  # refuses rules it cannot read before anything is made
        low, high = self.uid_range
        choose = (lambda used: pick_free_uid(used, low, high)) if self.privileged else None
        info = prepare_state(
            spec, state_root, self.name, uid_choice=choose, own_disk=self.privileged,
            own_cgroup=True,
        )  # fmt: skip
        try:
            return BubblewrapSandbox(spec, info, self)
        except BaseException:
            release_state(info)  # its cgroup and its own disk too
            raise
