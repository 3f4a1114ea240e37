"""How a box's processes are started: the launcher's and the tool server's command lines, the
environments of the box and of the host-side process that makes it, the host paths the box
needs to run the service's interpreter, and the waits for a box to come up.
"""

from __future__ import annotations

import contextlib
import os
import select
import site
import socket
import stat
import struct
import sys
import sysconfig
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from sandbox.base import DEFAULT_PATH, Limits, SandboxError, SandboxSpec
from sandbox.procs import LABEL_ID, LABEL_JOB
from sandbox.statedir import SocketIdentity

LAUNCHER = resources.files("sandbox").joinpath("launcher.py").read_text(encoding="utf-8")
"""The text of `sandbox/launcher.py`, the first program in every box, run with `python -S -I
-c`: sets the rlimits, leaves root for the box's uid when asked, says it is ready on a pipe
when given one, then execs the command (or waits forever when there is none)."""


def launcher_argv(
    python: str,
    limits: Limits,
    command: list[str],
    uid: int | None = None,
    ready_fd: int | None = None,
) -> list[str]:
    """The command line that runs `command` under `limits` (as host `uid`, when given),
    writing a line to `ready_fd` once the limits are in place (so the box is up)."""

    def arg(value: int | None) -> str:
        return "-" if value is None else str(value)

    return [
        python, "-S", "-I", "-c", LAUNCHER,
        arg(limits.cpu_seconds), arg(limits.memory_bytes), arg(limits.processes),
        arg(limits.file_size_bytes), arg(uid), arg(ready_fd), "--", *command,
    ]  # fmt: skip


def toolserver_argv(
    python: str, socket_path: str, workdir: str, socket_fd: int | None = None
) -> list[str]:
    """The tool server's command line: listening on `socket_fd` (a socket the host bound and
    passed in) when given, else on `socket_path`."""
    where = ["--socket", socket_path] if socket_fd is None else ["--socket-fd", str(socket_fd)]
    return [python, "-m", "sandbox.toolserver", *where, "--workdir", workdir]


def bind_tool_socket(path: Path) -> int:
    """Bind a Unix socket at `path` (in a directory only the service writes), not listening
    yet, readable and writable by the service alone; return its inheritable descriptor.

    The tool server calls listen() on it inside the box, so a connection's peer credentials
    name the tool server, not the host process that made the socket.
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a stale socket from an earlier start
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
    except OSError as exc:
        sock.close()
        raise SandboxError(f"cannot make the tool socket {path}: {exc}") from exc
    fd = sock.detach()
    os.set_inheritable(fd, True)
    return fd


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that listens on the other end of `sock`, as the
    kernel recorded them at listen() (pid and uid as this process's namespaces see them)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, gid = struct.unpack("iII", raw)
    return pid, uid, gid


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[-1].split()[1])


def descends_from(pid: int, ancestor: int) -> bool:
    """True if `pid` is `ancestor` or one of its descendants (walking /proc)."""
    for _ in range(256):
        if pid == ancestor:
            return True
        parent = _parent_pid(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def record_tool_socket(path: Path, box_pid: int | None) -> SocketIdentity:
    """The identity of the tool server listening at `path`: the socket file's device and
    inode (never through a symlink) and the listening process's pid and uid. With `box_pid`
    (the host pid of the box's main process), the listener must be that process or one of
    its descendants; SandboxError otherwise."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SandboxError(f"the tool socket {path} is gone: {exc}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise SandboxError(f"{path} is not a socket (mode {st.st_mode:o})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(str(path))
        except OSError as exc:
            raise SandboxError(f"cannot connect to the tool socket {path}: {exc}") from exc
        pid, uid, _gid = peer_credentials(probe)
    if pid <= 0:
        raise SandboxError(f"the process listening on {path} is not visible from the host")
    if box_pid is not None and not descends_from(pid, box_pid):
        raise SandboxError(
            f"the process listening on {path} (pid {pid}) is not in the box (pid {box_pid})"
        )
    return SocketIdentity(dev=st.st_dev, ino=st.st_ino, pid=pid, uid=uid)


def package_dir() -> Path:
    """The directory of the `sandbox` package, the only part of the service a box runs
    (`python -m sandbox.toolserver` imports nothing else of it)."""
    return Path(__file__).resolve().parent


# Prefixes that hold the whole system, not just Python: never bound whole over a root.
_SYSTEM_PREFIXES = frozenset({Path("/"), Path("/usr"), Path("/usr/local")})


def service_paths() -> list[Path]:
    """Host paths a box needs read-only to run the service's interpreter and the tool server.

    A prefix of its own (a venv, pyenv, conda) is taken whole; of a system prefix (`/usr`)
    only Python's parts: the interpreter, the standard library and site-packages. Of the
    service's own code only the `sandbox` package, at its host path: the box's Python finds
    it as the service's does (through site-packages, where an editable install's finder or
    `.pth` names that path), and the rest of a checkout holding it (results, state, logs,
    the other packages) stays out of the box.
    """
    interpreter = Path(os.path.realpath(sys.executable))
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    prefixes.add(interpreter.parent.parent)
    candidates = {package_dir()}
    candidates.update(p for p in prefixes if p not in _SYSTEM_PREFIXES)
    if prefixes & _SYSTEM_PREFIXES:
        candidates.add(interpreter)
        parts = [sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
        parts += site.getsitepackages()
        candidates.update(Path(p).resolve() for p in parts if os.path.exists(p))
    return sorted(p for p in candidates if not any(o != p and o in p.parents for o in candidates))


def box_env(
    spec: SandboxSpec,
    sandbox_id: str,
    extra: dict[str, str] | None = None,
    defaults: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a box's processes: sane defaults, the spec's, the call's, and the
    labels (last, so they cannot be overridden)."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    env.update(defaults or {})
    env.update(spec.env)
    env.update(extra or {})
    env[LABEL_ID] = sandbox_id
    env[LABEL_JOB] = spec.job_id
    return env


def host_env(sandbox_id: str, job_id: str) -> dict[str, str]:
    """The environment of the host-side process that makes a box (bwrap, apptainer)."""
    return {
        "PATH": os.environ.get("PATH", DEFAULT_PATH),
        "LANG": "C.UTF-8",
        LABEL_ID: sandbox_id,
        LABEL_JOB: job_id,
    }


def await_ready(fd: int, deadline: float) -> None:
    """Return once the launcher wrote its ready line to the pipe `fd`; raise SandboxError if
    the pipe closes first (the box died) or `deadline` (a monotonic time) passes."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxError("the box was not up in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            if os.read(fd, 64):
                return
            raise SandboxError("the box exited while it was being set up")


def wait_for_socket(path: Path, deadline: float, still_running: Callable[[], bool]) -> None:
    """Return once `path` accepts a connection; raise SandboxError when `still_running()`
    turns false or `deadline` (a monotonic time) passes."""
    while True:
        if path.exists():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(str(path))
                    return
                except OSError:
                    pass
        if not still_running():
            raise SandboxError("the box exited before its tool server listened")
        if time.monotonic() > deadline:
            raise SandboxError(f"the tool server did not listen on {path} in time")
        time.sleep(0.005)
