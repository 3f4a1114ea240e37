"""Nothing is left per job in the sandbox directory once its box is released or reaped: no
keeper log, no state dir, no tombstone, no job data; only what the directory keeps for every
job alike (the root's uid lock, the grading and job data roots)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.base import SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.keeper import SandboxStartError, launch, log_path, release
from sandbox.reaper import JOB_DATA_DIR, JOB_FILE, job_data_dir, reap
from sandbox.statedir import remove_tree
from tests.support.sandbox import find_job_processes, leftovers


def backend_or_skip(name: str) -> str:
    if name == "bwrap":
        ok, why = BubblewrapBackend().available()
        if not ok:
            pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    return name


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rs-left-", dir="/tmp"))
    yield path
    remove_tree(path)


def job(tag: str) -> str:
    return f"left-{tag}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("backend", ["local", "bwrap"])
def test_released_boxes_leave_nothing_of_their_jobs(root: Path, backend: str) -> None:
    backend = backend_or_skip(backend)
    jobs = [job(backend) for _ in range(3)]
    for job_id in jobs:
        kept = launch(SandboxSpec(job_id=job_id), backend, root)
        assert log_path(root, job_id).exists()  # the keeper's log lives with its box
        release(kept)
        assert find_job_processes(job_id) == []
    assert leftovers(root) == []


def test_a_keeper_killed_outright_leaves_what_the_reaper_then_removes(root: Path) -> None:
    job_id = job("killed")
    kept = launch(SandboxSpec(job_id=job_id), "local", root)
    os.kill(kept.keeper_pid, signal.SIGKILL)
    os.waitpid(kept.keeper_pid, 0)
    assert log_path(root, job_id).exists() and leftovers(root)
    reap(root, lambda other: other != job_id)
    assert find_job_processes(job_id) == []
    assert leftovers(root) == []
    release(kept)  # the owner's release, after the reaper's, is harmless
    assert leftovers(root) == []


def test_a_box_that_does_not_start_leaves_no_keeper_log(root: Path) -> None:
    job_id = job("failed")
    spec = SandboxSpec(job_id=job_id, workspace=Path("/proc/self/no-workspace-here"))
    with pytest.raises(SandboxStartError):
        launch(spec, "local", root)
    assert not log_path(root, job_id).exists()
    # A state dir the failed create had begun is the reaper's once its grace is over.
    reap(root, lambda other: other != job_id, now=time.time() + 3600)
    assert leftovers(root) == []


def test_job_data_stays_while_its_job_lives_and_goes_once_it_is_over(root: Path) -> None:
    live, over = job("live"), job("over")
    for job_id in (live, over):
        data = job_data_dir(root, job_id)
        data.mkdir(parents=True)
        (data / JOB_FILE).write_text(job_id)
        (data / "repo").mkdir()
        log_path(root, job_id).write_text("")
    crashed = root / JOB_DATA_DIR / ".build-0123"
    crashed.mkdir()
    reap(root, lambda job_id: job_id == live)
    assert job_data_dir(root, live).is_dir() and log_path(root, live).exists()
    assert not job_data_dir(root, over).exists() and not log_path(root, over).exists()
    assert crashed.exists()  # maybe still being made: removed after the grace
    reap(root, lambda job_id: False, now=time.time() + 3600)
    assert leftovers(root) == []


def test_a_job_whose_state_cannot_be_told_keeps_its_data(root: Path) -> None:
    job_id = job("unknown")
    data = job_data_dir(root, job_id)
    data.mkdir(parents=True)
    (data / JOB_FILE).write_text(job_id)

    def unreachable(_: str) -> bool:
        raise ConnectionError("the job store is down")

    reap(root, unreachable)
    assert data.is_dir()
