"""Child processes that die with their owner: free ports, parent-death signals, group kills."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """For `preexec_fn`: the kernel sends SIGTERM to this child when its parent dies.

    Also starts a new process group so the owner can stop the child's whole tree at once.
    """
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    log_path: str | None = None,
    preexec: Callable[[], None] = die_with_parent,
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group, tied to this process's life."""
    stdout = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
    finally:
        if log_path:
            stdout.close()  # type: ignore[union-attr]


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the child's process group, wait, then SIGKILL whatever is left."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers of a dead leader
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    _kill_group(proc.pid, signal.SIGKILL)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_for_port(
    host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll until something accepts on `host:port`; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process {proc.args!r} exited with {proc.returncode} before listening"
            )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout:.0f}s")
