"""The orphan reaper: what it takes, what it leaves, and that two sweeps never fight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sandbox.reaper import ORPHAN_GRACE_SECONDS, list_sandboxes, reap
from sandbox.statedir import meta_path
from tests.support.wait import wait_until

if TYPE_CHECKING:
    from sandbox.bwrap import BubblewrapBackend
    from tests.support.sandbox import SandboxFactory


JobProcesses = Callable[[str], list[int]]


def always_live(job_id: str) -> bool:
    return True


def test_list_sandboxes_describes_each_from_its_meta(
    bwrap_sandbox: SandboxFactory, state_root: Path
) -> None:
    box = bwrap_sandbox(lease_seconds=120)
    box.start(tool_server=False)
    [info] = list_sandboxes(state_root)
    assert (info.id, info.job_id, info.backend) == (box.id, box.job_id, "bwrap")
    assert info.pid is not None and info.pgid == info.pid
    assert info.host == os.uname().nodename
    assert info.lease_expires == pytest.approx(info.created + 120)
    assert info.state_dir == box.state_dir


def test_the_reaper_kills_a_sandbox_whose_job_is_no_longer_live(
    bwrap_sandbox: SandboxFactory,
    state_root: Path,
    job_processes: JobProcesses,
    command_running: Callable[[str, str], None],
) -> None:
    ended, live = bwrap_sandbox(), bwrap_sandbox()
    for box in (ended, live):
        box.start(tool_server=False)
    running = threading.Thread(target=lambda: ended.exec(["sleep", "1000"]), daemon=True)
    running.start()
    command_running(ended.job_id, "sleep")
    reaped = reap(state_root, lambda job_id: job_id != ended.job_id)
    assert reaped == [ended.id]
    running.join(10)
    assert not running.is_alive()  # its exec was killed too
    assert job_processes(ended.job_id) == []
    assert not ended.state_dir.exists()
    assert not ended.alive()
    assert live.alive() and live.state_dir.exists()


def test_the_reaper_kills_a_sandbox_whose_lease_expired(
    bwrap_sandbox: SandboxFactory, state_root: Path, job_processes: JobProcesses
) -> None:
    short, long = bwrap_sandbox(lease_seconds=60), bwrap_sandbox(lease_seconds=3600)
    for box in (short, long):
        box.start(tool_server=False)
    assert reap(state_root, always_live, now=time.time() + 61) == [short.id]
    assert job_processes(short.job_id) == []
    assert long.alive()


def test_the_reaper_leaves_a_live_sandbox_alone(
    bwrap_sandbox: SandboxFactory, state_root: Path
) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=False)
    assert reap(state_root, always_live) == []
    assert box.alive()
    assert box.exec(["echo", "still here"]).stdout == "still here\n"


def test_a_sandbox_stays_when_its_jobs_state_cannot_be_told(
    bwrap_sandbox: SandboxFactory, state_root: Path
) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=False)

    def unreachable(job_id: str) -> bool:
        raise ConnectionError("redis is down")

    assert reap(state_root, unreachable) == []
    assert box.alive()


def test_a_crashed_workers_box_dies_with_it_and_the_reaper_clears_what_is_left(
    bwrap_backend: BubblewrapBackend, state_root: Path, job_processes: JobProcesses
) -> None:
    job_id = f"crash-{os.getpid()}-{time.monotonic_ns()}"
    worker = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from sandbox.base import SandboxSpec\n"
        "from sandbox.bwrap import BubblewrapBackend\n"
        f"box = BubblewrapBackend().create(SandboxSpec(job_id={job_id!r}), Path(sys.argv[1]))\n"
        "box.start(tool_server=False)\n"
        "print(box.id, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", worker, str(state_root)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        sandbox_id = proc.stdout.readline().decode().strip()
        assert sandbox_id and job_processes(job_id)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # bwrap --die-with-parent took the box along
        wait_until(lambda: job_processes(job_id) == [], 5, "the box to go", interval=0.01)
        assert (state_root / sandbox_id).exists()  # only its state is left
        assert reap(state_root, always_live) == [sandbox_id]
        assert not (state_root / sandbox_id).exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_concurrent_sweeps_reap_each_sandbox_once(
    bwrap_sandbox: SandboxFactory, state_root: Path, job_processes: JobProcesses
) -> None:
    boxes = [bwrap_sandbox() for _ in range(4)]
    for box in boxes:
        box.start(tool_server=False)
    results: list[list[str]] = []
    gate = threading.Barrier(4)

    def sweep() -> None:
        gate.wait()
        results.append(reap(state_root, lambda job_id: False))

    sweeps = [threading.Thread(target=sweep) for _ in range(4)]
    for thread in sweeps:
        thread.start()
    for thread in sweeps:
        thread.join(30)
    reaped = [sandbox_id for result in results for sandbox_id in result]
    assert sorted(reaped) == sorted(box.id for box in boxes)
    assert all(job_processes(box.job_id) == [] for box in boxes)


def test_the_owner_may_stop_a_sandbox_the_reaper_took(
    bwrap_sandbox: SandboxFactory, state_root: Path
) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=False)
    assert reap(state_root, lambda job_id: False) == [box.id]
    box.stop()
    assert not box.alive()


def test_sandboxes_another_host_recorded_are_left_to_it(
    local_sandbox: SandboxFactory, state_root: Path
) -> None:
    box = local_sandbox()
    meta = json.loads(meta_path(box.state_dir).read_text())
    meta["host"] = "another-node"
    meta_path(box.state_dir).write_text(json.dumps(meta))
    assert reap(state_root, lambda job_id: False) == []
    assert box.state_dir.exists()


def test_a_state_dir_never_recorded_is_removed_after_a_grace(state_root: Path) -> None:
    half_made = state_root / "0123456789ab"
    half_made.mkdir()
    assert reap(state_root, always_live) == []
    assert half_made.exists()
    later = time.time() + ORPHAN_GRACE_SECONDS + 1
    assert reap(state_root, always_live, now=later) == ["0123456789ab"]
    assert not half_made.exists()


def test_a_missing_state_root_has_nothing_to_reap(tmp_path: Path) -> None:
    assert reap(tmp_path / "nowhere", always_live) == []
    assert list_sandboxes(tmp_path / "nowhere") == []


def test_a_box_halted_for_grading_while_a_sweep_looked_is_not_reaped(
    bwrap_sandbox: SandboxFactory, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.reaper

    box = bwrap_sandbox()
    box.start(tool_server=False)
    real_locked = sandbox.reaper.locked

    def halted_meanwhile(path: Path, *, blocking: bool = True) -> Any:
        # The sweep read the record before the halt; the halt takes the lock first, records
        # the box as halted and kills its processes, as a RUN that ends does.
        box.halt()
        return real_locked(path, blocking=blocking)

    monkeypatch.setattr(sandbox.reaper, "locked", halted_meanwhile)
    monkeypatch.setattr(sandbox.reaper, "why_reap", counting(sandbox.reaper.why_reap))
    assert reap(state_root, always_live) == []
    assert box.state_dir.exists() and box.halted


def counting(why_reap: Callable[..., str | None]) -> Callable[..., str | None]:
    """`why_reap`, whose first answer for a box says its box is gone (its main process was
    already dead when the sweep first looked), as the halt that follows makes it."""
    calls: list[object] = []

    def decide(info: Any, live: Callable[[str], bool], now: float) -> str | None:
        calls.append(info)
        return "its box is gone" if len(calls) == 1 else why_reap(info, live, now)

    return decide
