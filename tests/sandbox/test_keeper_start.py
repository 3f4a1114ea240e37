"""A keeper whose first line is not its report is ended, with its box, and the start fails
saying what came instead: nothing of it is left running."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import sandbox.keeper
from sandbox.base import SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.keeper import KEEPER_LABEL, SandboxStartError, launch
from tests.support.sandbox import new_job_id


def keepers_of(job_id: str) -> list[int]:
    needle = f"{KEEPER_LABEL}={job_id}".encode()
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(name))
    return found


@pytest.fixture
def chatty_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keepers run by an interpreter that says a word on stdout before anything else."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho 'starting up'\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(sandbox.keeper.sys, "executable", str(wrapper))


@pytest.mark.usefixtures("chatty_python")
def test_a_keeper_whose_first_line_is_not_json_is_ended_with_its_box(
    bwrap_backend: BubblewrapBackend,
    state_root: Path,
    job_processes: Callable[[str], list[int]],
) -> None:
    spec = SandboxSpec(job_id=new_job_id())
    with pytest.raises(SandboxStartError, match="first line is not its report: 'starting up'"):
        launch(spec, "bwrap", state_root)
    assert keepers_of(spec.job_id) == []
    assert job_processes(spec.job_id) == []
    assert [p for p in state_root.iterdir() if not p.name.startswith(".")] == []


def test_a_keeper_given_a_spec_that_is_not_json_exits_saying_so(state_root: Path) -> None:
    from sandbox.keeper import main

    read, write = os.pipe()
    os.write(write, b"not json\n")
    os.close(write)
    saved = sys.stdin
    with os.fdopen(read) as stdin:
        sys.stdin = stdin
        try:
            assert main(["--backend", "bwrap", "--state-root", str(state_root)]) == 1
        finally:
            sys.stdin = saved


def test_the_keeper_of_a_halted_box_leaves_once_a_sweep_reaps_the_box(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    from sandbox.keeper import halt, is_kept
    from sandbox.reaper import reap
    from tests.support.wait import wait_until

    spec = SandboxSpec(job_id=new_job_id())
    kept = launch(spec, "bwrap", state_root)
    try:
        halt(kept)  # its processes gone on purpose: nothing of the box is running
        assert is_kept(kept)
        assert reap(state_root, lambda _job: False) == [kept.id]
        # Its lease is long; the keeper sees its state dir gone and leaves now.
        wait_until(lambda: not is_kept(kept), 10, "the keeper to leave")
    finally:
        sandbox.keeper.release(kept)
    assert keepers_of(spec.job_id) == []
