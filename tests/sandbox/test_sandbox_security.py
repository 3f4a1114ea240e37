"""What an agent's commands cannot do in a bubblewrap box, shown against real bubblewrap."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sandbox.base import Limits
from sandbox.bwrap import BubblewrapBackend
from sandbox.network import missing
from tests.support.sandbox import sandbox_factory

if TYPE_CHECKING:
    from tests.support.sandbox import Listener, SandboxFactory


JobProcesses = Callable[[str], list[int]]


def connect(port: int) -> list[str]:
    """A command that connects to the host's 127.0.0.1:`port` and prints what it reads."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
        "    print('read', s.recv(100).decode().strip())\n"
        "except OSError as exc:\n"
        "    print('failed', exc)\n"
        "    sys.exit(3)\n"
    )
    return ["python3", "-c", code]


@pytest.fixture
def exposing_sandbox(
    bwrap_backend: BubblewrapBackend, state_root: Path, visible_host_dir: Path
) -> Iterator[SandboxFactory]:
    """Like `bwrap_sandbox`, with `visible_host_dir` among the host paths the boxes see."""
    backend = BubblewrapBackend(extra_paths=[str(visible_host_dir)])
    yield from sandbox_factory(backend, state_root)


def test_a_command_cannot_write_outside_its_workspace(
    exposing_sandbox: SandboxFactory, visible_host_dir: Path
) -> None:
    existing = visible_host_dir / "existing.txt"
    existing.write_text("original\n")
    existing.chmod(0o666)
    visible_host_dir.chmod(0o777)  # even where file permissions would allow it
    marker = f"rollserve-test-{uuid.uuid4().hex}"
    box = exposing_sandbox()
    assert box.exec(["cat", str(existing)]).stdout == "original\n"  # seen, read-only
    attempts = {
        "append to a host file": f"echo changed >> {existing}",
        "create in a host dir": f"touch {visible_host_dir}/new",
        "create in /etc": "touch /etc/rollserve-pwned",
        "create in /usr/bin": "touch /usr/bin/rollserve-pwned",
        "create at /": "mkdir /rollserve-pwned",
        "remove a host file": f"rm -f {existing}",
        "remount / read-write": "mount -o remount,rw / 2>&1 || exit 1",
    }
    for what, command in attempts.items():
        result = box.exec(["sh", "-c", command])
        assert result.returncode != 0, f"{what} succeeded: {result}"
    # /tmp is the box's own: writing there leaves the host's /tmp alone.
    assert box.exec(["sh", "-c", f"echo x > /tmp/{marker}"]).returncode == 0
    assert not Path("/tmp", marker).exists()
    assert existing.read_text() == "original\n"
    assert sorted(p.name for p in visible_host_dir.iterdir()) == ["existing.txt"]
    assert not Path("/etc/rollserve-pwned").exists()


def test_a_command_cannot_read_host_files_outside_the_binds(
    bwrap_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    in_root_home = Path("/root") / f".rollserve-test-{uuid.uuid4().hex}"
    in_host_tmp = tmp_path / "key.txt"
    in_host_tmp.write_text(secret)
    neighbour = bwrap_sandbox()
    (neighbour.workspace / "answer.txt").write_text(secret)
    in_root_home.write_text(secret)
    try:
        in_root_home.chmod(0o600)
        box = bwrap_sandbox()
        for path in (in_root_home, in_host_tmp, neighbour.workspace / "answer.txt"):
            result = box.exec(["cat", str(path)])
            assert result.returncode != 0 and secret not in result.stdout, path
            assert "No such file or directory" in result.stderr
        # The other sandbox's state dir, socket and all, is not even there.
        listing = box.exec(["ls", "-a", str(neighbour.state_dir.parent)])
        assert neighbour.id not in listing.stdout
    finally:
        in_root_home.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="the box runs as the service's user otherwise")
def test_as_root_the_box_cannot_read_root_only_files_of_the_host(
    exposing_sandbox: SandboxFactory, visible_host_dir: Path
) -> None:
    secret = visible_host_dir / "root-only.txt"
    secret.write_text("for root alone\n")
    secret.chmod(0o600)
    box = exposing_sandbox()
    result = box.exec(["cat", str(secret)])
    assert result.returncode != 0
    assert "Permission denied" in result.stderr
    # /etc/shadow is not even there.
    assert "No such file or directory" in box.exec(["cat", "/etc/shadow"]).stderr


def test_the_box_runs_without_privileges(bwrap_sandbox: SandboxFactory) -> None:
    status = bwrap_sandbox().exec(["cat", "/proc/self/status"]).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["NoNewPrivs"].strip() == "1"
    assert int(fields["CapEff"], 16) == 0
    assert int(fields["CapPrm"], 16) == 0


def test_the_box_sees_only_its_own_processes(bwrap_sandbox: SandboxFactory) -> None:
    result = bwrap_sandbox().exec(["sh", "-c", "ls /proc | grep -c '^[0-9]'"])
    # bwrap's init, the shell, ls and grep: nothing of the host's.
    assert int(result.stdout) <= 5


def test_a_command_cannot_open_a_network_connection_when_network_is_off(
    bwrap_sandbox: SandboxFactory, host_listener: Listener
) -> None:
    result = bwrap_sandbox(network=False).exec(connect(host_listener.port))
    assert result.returncode == 3, result
    assert result.stdout.startswith("failed")
    assert host_listener.accepted == 0


def test_a_command_cannot_reach_the_hosts_loopback_when_network_is_on(
    bwrap_sandbox: SandboxFactory, bwrap_backend: BubblewrapBackend, host_listener: Listener
) -> None:
    lacking = missing(bwrap_backend.privileged)
    if lacking:
        pytest.skip(f"boxes with network need {', '.join(lacking)}")
    result = bwrap_sandbox(network=True).exec(connect(host_listener.port))
    assert result.returncode == 3, result
    assert result.stdout.startswith("failed")
    assert host_listener.accepted == 0


class Responsiveness:
    """Times a trivial host command over and over while a test runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            subprocess.run(["true"], check=True)
            self.worst = max(self.worst, time.perf_counter() - started)
            self._stop.wait(0.05)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(10)
        return self.worst


@pytest.fixture
def host_responsiveness() -> Iterator[Responsiveness]:
    probe = Responsiveness()
    yield probe
    probe.stop()


def test_a_fork_bomb_is_contained_and_reported(
    bwrap_sandbox: SandboxFactory,
    job_processes: JobProcesses,
    host_responsiveness: Responsiveness,
) -> None:
    box = bwrap_sandbox(limits=Limits(processes=64))
    started = time.perf_counter()
    result = box.exec(["bash", "-c", ":(){ :|:& };:; sleep 30"], timeout=3)
    took = time.perf_counter() - started
    assert result.killed_by == "processes", result
    assert "fork" in result.stderr
    assert took < 6
    assert job_processes(box.job_id) == []  # the bomb's processes died with its box
    assert host_responsiveness.stop() < 1.0


def test_a_fork_bomb_stops_at_the_process_limit(bwrap_sandbox: SandboxFactory) -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError as exc:\n"
        "    print(children)\n"
        "    raise\n"
    )
    result = bwrap_sandbox(limits=Limits(processes=40)).exec(["python3", "-c", code])
    assert result.killed_by == "processes", result
    # The box's other processes (bwrap's init, this Python) count against the limit too.
    assert 30 <= int(result.stdout) < 40


def test_a_memory_hog_is_contained_and_reported(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox(limits=Limits(memory_bytes=256 << 20))
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    result = box.exec(["python3", "-c", hog], timeout=30)
    assert result.returncode != 0
    assert not result.timed_out
    assert result.killed_by == "memory_bytes", result
    assert "MemoryError" in result.stderr


def test_a_cpu_hog_is_stopped_at_its_cpu_seconds(bwrap_sandbox: SandboxFactory) -> None:
    result = bwrap_sandbox(limits=Limits(cpu_seconds=1)).exec(
        ["python3", "-c", "while True: pass"], timeout=20
    )
    assert result.killed_by == "cpu_seconds", result
    assert not result.timed_out


def test_a_file_beyond_the_size_limit_is_refused_and_reported(
    bwrap_sandbox: SandboxFactory,
) -> None:
    box = bwrap_sandbox(limits=Limits(file_size_bytes=1 << 20))
    result = box.exec(["sh", "-c", "head -c 2000000 /dev/zero > /workspace/big"])
    assert result.killed_by == "file_size_bytes", result
    assert (box.workspace / "big").stat().st_size <= 1 << 20


def test_a_command_that_never_ends_is_stopped_by_its_timeout(
    bwrap_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    box = bwrap_sandbox()
    started = time.perf_counter()
    result = box.exec(["sh", "-c", "sleep 1000 & sleep 1000"], timeout=1)
    assert time.perf_counter() - started < 3
    assert result.timed_out
    assert result.killed_by == "SIGKILL"
    assert job_processes(box.job_id) == []


def test_background_processes_end_with_their_command(
    bwrap_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    box = bwrap_sandbox()
    result = box.exec(["sh", "-c", "setsid sleep 1000 > /dev/null 2>&1 & echo detached"])
    assert result.stdout == "detached\n"
    assert job_processes(box.job_id) == []


def test_stopping_a_sandbox_leaves_no_process_behind(
    bwrap_sandbox: SandboxFactory,
    job_processes: JobProcesses,
    command_running: Callable[[str, str], None],
) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=False)
    outcome: list[object] = []
    running = threading.Thread(
        target=lambda: outcome.append(box.exec(["sleep", "1000"], timeout=60)), daemon=True
    )
    running.start()
    command_running(box.job_id, "sleep")
    assert len(job_processes(box.job_id)) >= 4  # the box's and the exec's processes
    started = time.perf_counter()
    box.stop()
    running.join(10)
    assert time.perf_counter() - started < 5
    assert job_processes(box.job_id) == []
    assert not box.state_dir.exists()
    assert outcome and getattr(outcome[0], "killed_by", None) == "SIGKILL"
