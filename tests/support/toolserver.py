"""Fixtures that run the tool server as a real subprocess on a Unix socket.

The root conftest.py loads them as a plugin, so every test can ask for them.

- `toolserver`: a fresh server for one test, working in its own temporary directory.
- `start_toolserver`: start more (`start_toolserver(args=[...], argv=[...])`).

Every server is stopped after its test: SIGTERM first (the server's own clean-up path),
then SIGKILL for the server and for every descendant it had, by pid, so nothing outlives
the test even when the server misbehaves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sandbox.toolclient import ToolClient
from sandbox.toolserver.processes import descendants

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 15.0


@dataclass
class ToolServerProcess:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    workdir: Path
    clients: list[ToolClient] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout: float = 30.0) -> ToolClient:
        """A client of this server, closed when the test ends."""
        client = ToolClient(self.socket_path, timeout=timeout)
        self.clients.append(client)
        return client

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        victims = set(self.descendants())
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def short_tempdir(prefix: str = "rs-tools-") -> Path:
    """A directory with a path short enough for a Unix socket (at most 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def wait_until_ready(server: ToolServerProcess, timeout: float = START_TIMEOUT) -> None:
    client = ToolClient(server.socket_path, timeout=5)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"tool server exited with {server.proc.returncode}")
            try:
                client.ping()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    finally:
        client.close()


StartToolServer = Callable[..., ToolServerProcess]


@pytest.fixture
def start_toolserver() -> Iterator[StartToolServer]:
    """`start(args=[...], argv=None, workdir=None)`: a running server, stopped at test end.

    `argv` replaces the whole command line (to run the server under bwrap, say); the
    socket is then expected at `<socket dir>/tools.sock` as usual.
    """
    started: list[ToolServerProcess] = []
    directories: list[Path] = []

    def start(
        args: list[str] | None = None,
        argv: Callable[[Path, Path], list[str]] | None = None,
        workdir: Path | None = None,
    ) -> ToolServerProcess:
        base = short_tempdir()
        directories.append(base)
        socket_path = base / "tools.sock"
        work = workdir or base / "work"
        work.mkdir(parents=True, exist_ok=True)
        command = (
            argv(base, work)
            if argv is not None
            else [
                sys.executable,
                "-m",
                "sandbox.toolserver",
                "--socket",
                str(socket_path),
                "--workdir",
                str(work),
                *(args or []),
            ]
        )
        proc = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL)
        server = ToolServerProcess(proc, socket_path, work)
        started.append(server)
        wait_until_ready(server)
        return server

    yield start
    for server in started:
        server.stop()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def toolserver(start_toolserver: StartToolServer) -> ToolServerProcess:
    return start_toolserver()
