"""Which backend `auto` picks, and what a host that cannot hold a box's limits does: `auto`
never falls back to `local` (no isolation) unless `ROLLSERVE_SANDBOX_ALLOW_LOCAL` says so, and
a box with memory and process limits does not start where no cgroup can hold them unless
`ROLLSERVE_SANDBOX_ALLOW_UNLIMITED` says so."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandbox.backends
import sandbox.cgroups
from sandbox.backends import get_backend
from sandbox.base import ALLOW_LOCAL_ENV, ALLOW_UNLIMITED_ENV, Limits, SandboxError, SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from tests.support.sandbox import new_job_id
from workers.boxreport import node_report


def unavailable_bwrap() -> BubblewrapBackend:
    backend = BubblewrapBackend()
    why = "bubblewrap is not installed (apt-get install bubblewrap)"
    backend.available = lambda: (False, why)  # type: ignore[assignment]
    return backend


@pytest.fixture
def no_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host where neither apptainer nor bwrap works."""
    monkeypatch.setitem(sandbox.backends.BACKENDS, "bwrap", unavailable_bwrap)
    monkeypatch.delenv(ALLOW_LOCAL_ENV, raising=False)
    node_report.cache_clear()


@pytest.mark.usefixtures("no_isolation")
def test_auto_never_falls_back_to_local_by_itself(state_root: Path) -> None:
    backend = get_backend("auto")
    assert backend.name != "local"
    ok, why = backend.available()
    assert not ok and ALLOW_LOCAL_ENV in why and "bubblewrap is not installed" in why
    with pytest.raises(SandboxError, match=ALLOW_LOCAL_ENV):
        backend.create(SandboxSpec(job_id=new_job_id()), state_root)
    assert list(state_root.iterdir()) == []
    report = node_report("auto")
    assert not any(limit["enforced"] for limit in report.values())
    node_report.cache_clear()


@pytest.mark.usefixtures("no_isolation")
def test_auto_falls_back_to_local_when_the_setting_allows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALLOW_LOCAL_ENV, "1")
    assert get_backend("auto").name == "local"


@pytest.fixture
def no_cgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox.cgroups, "host_cgroups", lambda: (None, "none in this test"))
    monkeypatch.delenv(ALLOW_UNLIMITED_ENV, raising=False)


@pytest.mark.usefixtures("no_cgroups")
def test_a_box_whose_limits_cannot_be_held_does_not_start(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    spec = SandboxSpec(job_id=new_job_id(), limits=Limits(box_memory_bytes=256 << 20))
    with pytest.raises(SandboxError, match=ALLOW_UNLIMITED_ENV) as caught:
        bwrap_backend.create(spec, state_root)
    assert "none in this test" in str(caught.value)
    assert list(state_root.iterdir()) == []


@pytest.mark.usefixtures("no_cgroups")
def test_the_setting_lets_a_box_start_without_its_limits(
    bwrap_backend: BubblewrapBackend, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOW_UNLIMITED_ENV, "true")
    box = bwrap_backend.create(SandboxSpec(job_id=new_job_id()), state_root)
    try:
        assert box.info.cgroup is None
    finally:
        box.stop()


@pytest.mark.usefixtures("no_cgroups")
def test_a_box_without_memory_or_process_limits_needs_no_cgroup(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    spec = SandboxSpec(job_id=new_job_id(), limits=Limits(box_memory_bytes=None, box_pids=None))
    box = bwrap_backend.create(spec, state_root)
    box.stop()


def test_a_delegated_cgroup_hands_its_processes_to_a_leaf_and_holds_the_boxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox.boxdisk import MountEntry

    # A fake cgroup2 tree: this process in a unit whose cgroup systemd delegated to it
    # (Delegate=yes), nothing above it writable.
    mount = tmp_path / "cgroup"
    unit = mount / "system.slice" / "rollserve-worker@run.service"
    unit.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu memory pids io\n")
    for directory in (mount, mount / "system.slice"):
        (directory / "cgroup.subtree_control").write_text("cpu memory pids\n")
        (directory / "cgroup.procs").write_text("")
    (unit / "cgroup.controllers").write_text("cpu memory pids\n")
    (unit / "cgroup.subtree_control").write_text("")
    (unit / "cgroup.procs").write_text("4242\n")
    leaf_procs: list[str] = []
    real_write = sandbox.cgroups._write

    def write(path: str, value: str) -> None:
        if path == str(unit / "service" / "cgroup.procs"):
            leaf_procs.append(value)
            (unit / "cgroup.procs").write_text("")  # the kernel moves it out of the unit
            return
        if path.endswith("/rollserve/cgroup.subtree_control"):
            Path(path).write_text(value)
            return
        real_write(path, value)

    def made(path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=exist_ok)
        if path.endswith("/rollserve"):
            (Path(path) / "cgroup.controllers").write_text("cpu memory pids\n")

    table = [MountEntry("/", str(mount), "cgroup2", "rw")]
    monkeypatch.setattr(sandbox.cgroups, "mount_table", lambda: table)
    monkeypatch.setattr(
        sandbox.cgroups, "_own_cgroups", lambda: {"": "/system.slice/rollserve-worker@run.service"}
    )
    monkeypatch.setattr(sandbox.cgroups, "_write", write)
    monkeypatch.setattr(sandbox.cgroups.os, "makedirs", made)
    monkeypatch.setattr(
        sandbox.cgroups.os, "access", lambda path, mode: str(path).startswith(str(unit))
    )
    found, why = sandbox.cgroups._v2_parent()
    assert found is not None, why
    assert found.parents == (str(unit / "rollserve"),)
    assert leaf_procs == ["4242"]
    assert (unit / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
