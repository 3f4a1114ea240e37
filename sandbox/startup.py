"""How a box's processes are started: the launcher's and the tool server's command lines, the
environments of the box and of the host-side process that makes it, the host paths the box
needs to run the service's interpreter, and the waits for a box to come up.
"""

from __future__ import annotations

import os
import select
import site
import socket
import sys
import sysconfig
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from sandbox.base import DEFAULT_PATH, Limits, SandboxError, SandboxSpec
from sandbox.procs import LABEL_ID, LABEL_JOB

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


def toolserver_argv(python: str, socket_path: str, workdir: str) -> list[str]:
    """The tool server's command line."""
    return [python, "-m", "sandbox.toolserver", "--socket", socket_path, "--workdir", workdir]


def source_root() -> Path:
    """The directory holding the rollserve packages (so `-m sandbox.toolserver` imports)."""
    return Path(__file__).resolve().parent.parent


# Prefixes that hold the whole system, not just Python: never bound whole over a root.
_SYSTEM_PREFIXES = frozenset({Path("/"), Path("/usr"), Path("/usr/local")})


def service_paths() -> list[Path]:
    """Host paths a box needs read-only to run the service's interpreter and packages.

    A prefix of its own (a venv, pyenv, conda) is taken whole; of a system prefix (`/usr`)
    only Python's parts: the interpreter, the standard library and site-packages.
    """
    interpreter = Path(os.path.realpath(sys.executable))
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    prefixes.add(interpreter.parent.parent)
    candidates = {source_root()}
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
