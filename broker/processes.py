"""Child processes that die with their owner: free ports, parent-death signals, group kills."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


CLAIM_SECONDS = 900.0
"""How long a port `free_port` gave out stays out of its other callers' reach."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now, for a server about to be started on it.

    It lies below the kernel's ephemeral range, so no outgoing connection is given it before
    the server binds it, and it is claimed on this host (a file under the temporary directory)
    for `CLAIM_SECONDS`, so that no other caller, in this process or another, is handed the
    same port meanwhile. Where neither holds (a narrow range, no writable temporary
    directory), the kernel picks one."""
    start, end = _port_span()
    claims = _claims_dir()
    if claims is not None and end - start >= 256:
        for _ in range(200):
            port = random.randrange(start, end)
            if _claim(claims, port) and _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_span() -> tuple[int, int]:
    """Ports [start, end) below the kernel's ephemeral range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(1024, low - 12000), low


def _claims_dir() -> Path | None:
    path = Path(tempfile.gettempdir()) / f"rollserve-ports-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _claim(claims: Path, port: int) -> bool:
    """Claim `port` unless a claim younger than `CLAIM_SECONDS` holds it."""
    path = claims / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        if time.time() - path.stat().st_mtime < CLAIM_SECONDS:
            return False
        os.utime(path)  # a stale claim is taken over
        return True
    except OSError:
        return False


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


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
