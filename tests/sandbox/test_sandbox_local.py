"""The local backend: plain subprocesses in the sandbox's directory, for development."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sandbox.base import Limits, SandboxSpec
from sandbox.local import LocalBackend

if TYPE_CHECKING:
    from tests.support.sandbox import SandboxFactory


JobProcesses = Callable[[str], list[int]]


def test_every_create_warns_loudly_that_there_is_no_isolation(
    state_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sandbox.local"):
        box = LocalBackend().create(SandboxSpec(job_id="loud"), state_root)
    box.stop()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "NO ISOLATION" in record.getMessage()
    assert box.id in record.getMessage()


def test_commands_run_in_the_workspace_with_the_spec_env(local_sandbox: SandboxFactory) -> None:
    box = local_sandbox(env={"GREETING": "hello"})
    (box.workspace / "in.txt").write_text("from the host\n")
    result = box.exec(["sh", "-c", 'pwd; cat in.txt; echo "$GREETING" > out.txt'])
    assert result.stdout == f"{box.workspace}\nfrom the host\n"
    assert (box.workspace / "out.txt").read_text() == "hello\n"


def test_start_stop_are_idempotent_and_fast(
    local_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    box = local_sandbox()
    box.start(tool_server=False)
    box.start(tool_server=False)
    assert box.alive() and job_processes(box.job_id)
    box.stop()
    box.stop()
    assert not box.alive()
    assert job_processes(box.job_id) == []
    assert not box.state_dir.exists()


def test_a_command_that_never_ends_is_stopped_by_its_timeout(
    local_sandbox: SandboxFactory,
) -> None:
    result = local_sandbox().exec(["sleep", "1000"], timeout=0.5)
    assert result.timed_out and result.killed_by == "SIGKILL"


def test_the_rlimits_still_apply(local_sandbox: SandboxFactory) -> None:
    box = local_sandbox(limits=Limits(memory_bytes=256 << 20))
    result = box.exec([sys.executable, "-c", "bytearray(1 << 30)"])
    assert result.killed_by == "memory_bytes", result


def test_stop_kills_what_left_the_process_group(
    local_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    box = local_sandbox()
    result = box.exec(["sh", "-c", "setsid sleep 1000 > /dev/null 2>&1 & echo left"])
    assert result.stdout == "left\n"
    assert job_processes(box.job_id)  # no pid namespace to take it along
    box.stop()
    assert job_processes(box.job_id) == []


@pytest.mark.usefixtures("toolserver_available")
def test_start_with_the_tool_server_returns_when_its_socket_accepts(
    local_sandbox: SandboxFactory,
) -> None:
    box = local_sandbox()
    box.start(tool_server=True, timeout=30)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(box.socket_path))
    assert box.alive()
