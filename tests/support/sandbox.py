"""Fixtures for the sandbox tests: short state roots, sandboxes that are always stopped, a
TCP listener on the host, and a scan of /proc for what a job left running.

The root conftest.py loads them as a plugin, so every test can ask for them.

- `bwrap_sandbox` / `local_sandbox`: `make(**spec_fields)` makes a sandbox for a fresh job;
  all are stopped at the end and must leave no process behind. `bwrap_sandbox` skips, saying
  why, where bubblewrap cannot make boxes.
- `toolserver_available`: skips unless `python -m sandbox.toolserver` exists.
- `job_processes`: `job_processes(job_id)` lists the live pids labelled with the job.
- `command_running`: `command_running(job_id, "sleep")` waits until the job runs `sleep`.
- `state_root`, `host_listener`, `visible_host_dir`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.local import LocalBackend
from sandbox.network import missing
from sandbox.procs import LABEL_JOB
from sandbox.reaper import GRADING_DIR, JOB_DATA_DIR
from sandbox.statedir import remove_tree


def find_job_processes(job_id: str) -> list[int]:
    """Pids of live processes labelled with `job_id`."""
    needle = f"{LABEL_JOB}={job_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(name))
    return found


def wait_for_command(job_id: str, command: str, timeout: float = 10.0) -> None:
    """Wait until a process of `job_id` runs `command` (its argv[0])."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in find_job_processes(job_id):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == command.encode():
                    return
        time.sleep(0.005)
    raise AssertionError(f"no process of {job_id} ran {command} within {timeout}s")


@pytest.fixture
def command_running() -> Callable[[str, str], None]:
    """`command_running(job_id, command)` waits until a process of the job runs `command`."""
    return wait_for_command


def new_job_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def state_root() -> Iterator[Path]:
    """A short state root (Unix socket paths hold 107 bytes), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    yield root
    remove_tree(root)


SandboxFactory = Callable[..., Sandbox]


def sandbox_factory(backend: SandboxBackend, state_root: Path) -> Iterator[SandboxFactory]:
    """`make(**spec_fields)` creates a sandbox for a fresh job; every one made is stopped
    at the end, and none may leave a process behind."""
    made: list[Sandbox] = []

    def make(**fields: Any) -> Sandbox:
        fields.setdefault("job_id", new_job_id())
        sandbox = backend.create(SandboxSpec(**fields), state_root)
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        sandbox.stop()
    leaks = {s.job_id: find_job_processes(s.job_id) for s in made}
    assert not any(leaks.values()), f"processes left behind: {leaks}"


@pytest.fixture
def bwrap_backend() -> BubblewrapBackend:
    backend = BubblewrapBackend()
    ok, why = backend.available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    return backend


@pytest.fixture
def bwrap_sandbox(bwrap_backend: BubblewrapBackend, state_root: Path) -> Iterator[SandboxFactory]:
    yield from sandbox_factory(bwrap_backend, state_root)


@pytest.fixture
def local_sandbox(state_root: Path) -> Iterator[SandboxFactory]:
    yield from sandbox_factory(LocalBackend(), state_root)


@pytest.fixture
def toolserver_available() -> None:
    if importlib.util.find_spec("sandbox.toolserver.__main__") is None:
        pytest.skip("the tool server (python -m sandbox.toolserver) is not in this tree yet")


@pytest.fixture
def job_processes() -> Callable[[str], list[int]]:
    return find_job_processes


class Listener:
    """A TCP server on the host's `host` (127.0.0.1; "0.0.0.0" for all its addresses) that
    counts the connections it accepts."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.server = socket.create_server((host, 0))
        self.port: int = self.server.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            with contextlib.suppress(OSError):
                conn.sendall(b"hello from the host\n")
            conn.close()

    def close(self) -> None:
        # Closing alone does not wake a thread blocked in accept(); shutting down does.
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self._thread.join(5)


@pytest.fixture
def host_listener() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.close()


@pytest.fixture
def visible_host_dir() -> Iterator[Path]:
    """A directory on the host outside /tmp, /root and /home, which a box on the host's root
    sees (read-only) when its backend is given it as an extra path."""
    path = Path(tempfile.mkdtemp(prefix="rollserve-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


SHARED = {".uids.lock", GRADING_DIR, JOB_DATA_DIR}
"""What a sandbox directory holds for all jobs alike (none of them names a job)."""


def leftovers(root: Path) -> list[str]:
    """Everything under `root` but the shared entries (and nothing may be under those)."""
    found = [p for p in root.rglob("*") if p.relative_to(root).parts[0] not in SHARED]
    for shared in (root / GRADING_DIR, root / JOB_DATA_DIR):
        if shared.is_dir():
            found += [p for p in shared.iterdir() if p.name != ".uids.lock"]
    return sorted(str(p.relative_to(root)) for p in found)


needs_box_network = pytest.mark.skipif(
    shutil.which("bwrap") is None or bool(missing(os.geteuid() == 0)),
    reason="boxes with network need bubblewrap, root, slirp4netns and nftables: "
    + ", ".join(missing(os.geteuid() == 0)),
)
"""For a module whose stack starts boxes with network (their own namespace behind the
egress proxy)."""
