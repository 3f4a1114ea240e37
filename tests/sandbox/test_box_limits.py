"""Limits that hold for a box as a whole, with real bubblewrap: memory and processes counted
over the main box and every `exec` together (one cgroup per box), tmpfs pages counted as
memory, the workspace, /tmp and /dev/shm sharing one size and one inode limit (one tmpfs per
box), and a box of many files stopped by a lazy unmount, leaving nothing behind.

Needs root and cgroups (the memory and pids ones) for boxes; skips saying why otherwise."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.apptainer import cgroup_options
from sandbox.base import ALLOW_UNLIMITED_ENV, ExecResult, Limits
from sandbox.boxdisk import can_mount
from sandbox.cgroups import enforced_limits, host_cgroups, kill_cgroup, read_counters, remove_cgroup
from sandbox.process import ProcessSandbox
from sandbox.statedir import discard_tree
from sandbox.toolclient import ToolClient
from sandbox.toolserver.bash import KILLED_NOTE
from tests.support.sandbox import SandboxFactory
from tests.support.wait import wait_until

MiB = 1 << 20
BoxFactory = Callable[..., ProcessSandbox]


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    with open("/proc/self/mountinfo") as file:
        return [line.split()[4] for line in file if line.split()[4].startswith(prefix)]


@pytest.fixture
def limited_box(bwrap_sandbox: SandboxFactory, state_root: Path) -> Iterator[BoxFactory]:
    """`make(**limits)`: a started bwrap box (no tool server) with those `Limits` fields. At
    the end every box is stopped and must leave no cgroup, no mount and no state dir."""
    cgroups, why = host_cgroups()
    if cgroups is None:
        pytest.skip(f"this host has no cgroups for boxes: {why}")
    made: list[ProcessSandbox] = []

    def make(*, tool_server: bool = False, **limits: Any) -> ProcessSandbox:
        box = bwrap_sandbox(limits=Limits(**limits))
        assert isinstance(box, ProcessSandbox)
        made.append(box)
        box.start(tool_server=tool_server)
        return box

    yield make
    for box in made:
        box.stop()
        assert not box.state_dir.exists()
        assert not [d for d in box.info.cgroup or () if os.path.exists(d)]
    assert mounts_under(state_root) == []


@pytest.fixture
def own_disk() -> None:
    ok, why = can_mount()
    if not ok:
        pytest.skip(f"boxes get no disk of their own here: {why}")


def run_together(*calls: Callable[[], ExecResult]) -> list[ExecResult]:
    results: list[ExecResult | None] = [None] * len(calls)

    def run(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


HOLD = (
    "import sys, time\n"
    "data = b'x' * ({mib} << 20)\n"  # written, so every page is charged
    "time.sleep({hold})\n"
    "print('survived', len(data))\n"
)


def test_two_processes_of_one_box_cannot_both_hold_most_of_its_memory(
    limited_box: BoxFactory,
) -> None:
    box = limited_box(box_memory_bytes=256 * MiB)
    hold = HOLD.format(mib=154, hold=4)  # 60% of the box's memory each
    first, second = run_together(
        lambda: box.exec(["python3", "-c", hold], timeout=60),
        lambda: box.exec(["python3", "-c", hold], timeout=60),
    )
    survivors = [r for r in (first, second) if "survived" in r.stdout]
    assert len(survivors) < 2, (first, second)
    killed = [r for r in (first, second) if r.killed_by == "box_memory"]
    assert killed and killed[0].returncode == 137, (first, second)
    assert read_counters(box.info.cgroup).oom_kills >= 1
    # The host and the box's other processes carry on.
    assert box.exec(["true"]).returncode == 0


def test_what_the_box_writes_to_its_tmpfs_counts_as_its_memory(
    limited_box: BoxFactory,
) -> None:
    # /tmp holds up to 1 GiB, the box's memory 128 MiB: the memory limit binds first.
    box = limited_box(box_memory_bytes=128 * MiB, disk_bytes=1 << 30)
    result = box.exec(["sh", "-c", "head -c 300M /dev/zero > /tmp/fill"], timeout=60)
    assert result.returncode != 0, result
    counters = read_counters(box.info.cgroup)
    assert counters.oom_kills >= 1 or "memory" in result.stderr.lower(), result
    fill = Path(box.info.disk or box.state_dir, "tmp", "fill")
    assert not fill.exists() or fill.stat().st_size < 128 * MiB


FORK = (
    "import os, sys, time\n"
    "children = 0\n"
    "try:\n"
    "    for _ in range({n}):\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(60)\n"
    "            os._exit(0)\n"
    "        children += 1\n"
    "except OSError:\n"
    "    print(children, flush=True)\n"
    "    raise\n"
    "print(children, flush=True)\n"
    "open('/workspace/{flag}', 'w').close()\n"
    "while not os.path.exists('/workspace/done'):\n"
    "    time.sleep(0.05)\n"
)


def test_the_process_limit_holds_over_every_exec_of_the_box(
    limited_box: BoxFactory,
) -> None:
    # The per-process rlimit is out of the way: only the box's cgroup counts.
    box = limited_box(box_pids=64, processes=None)
    holder: list[ExecResult] = []
    first = threading.Thread(
        target=lambda: holder.append(
            box.exec(["python3", "-c", FORK.format(n=40, flag="held")], timeout=60)
        )
    )
    first.start()
    try:
        wait_until(lambda: (box.workspace / "held").exists(), 30, "40 processes held")
        second = box.exec(["python3", "-c", FORK.format(n=40, flag="second")], timeout=60)
    finally:
        (box.workspace / "done").touch()
        first.join(60)
    assert holder and holder[0].stdout.strip() == "40", holder
    assert second.returncode != 0, second
    assert int(second.stdout) < 64 - 40
    assert second.killed_by == "box_pids", second


@pytest.mark.usefixtures("own_disk")
def test_the_workspace_tmp_and_shm_share_one_disk_limit(limited_box: BoxFactory) -> None:
    box = limited_box(disk_bytes=16 * MiB)
    fill = (
        "head -c 6M /dev/zero > /workspace/a && head -c 6M /dev/zero > /tmp/b && "
        "head -c 6M /dev/zero > /dev/shm/c"
    )
    result = box.exec(["sh", "-c", fill])
    assert result.returncode != 0
    assert "No space left on device" in result.stderr
    disk = Path(box.info.disk or "")
    used = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
    assert 12 * MiB <= used <= 16 * MiB


@pytest.mark.usefixtures("own_disk")
def test_the_workspace_tmp_and_shm_share_one_inode_limit(limited_box: BoxFactory) -> None:
    box = limited_box(disk_inodes=100)
    make = (
        "for i in $(seq 40); do "
        ": > /workspace/w$i && : > /tmp/t$i && : > /dev/shm/s$i || exit 7; done"
    )
    result = box.exec(["bash", "-c", make])
    assert result.returncode == 7, result
    assert "No space left on device" in result.stderr


@pytest.mark.usefixtures("own_disk")
def test_a_box_of_many_files_stops_leaving_nothing(limited_box: BoxFactory) -> None:
    box = limited_box()
    make = (
        "import os\n"
        "for d in range(200):\n"
        "    os.mkdir(f'/workspace/d{d}')\n"
        "    for f in range(1000):\n"
        "        open(f'/workspace/d{d}/f{f}', 'w').close()\n"
        "print(len(os.listdir('/workspace')))\n"
    )
    result = box.exec(["python3", "-c", make], timeout=300)
    assert result.stdout.strip() == "200", result
    cgroup = list(box.info.cgroup or [])
    box.stop()  # the fixture checks that nothing is left: no state dir, cgroup or mount
    assert not box.state_dir.exists()
    assert cgroup and not any(os.path.exists(d) for d in cgroup)
    with open("/proc/mounts") as file:
        assert str(box.state_dir) not in file.read()


@pytest.mark.usefixtures("toolserver_available")
def test_the_bash_tool_says_a_command_was_killed_at_the_memory_limit(
    limited_box: BoxFactory,
) -> None:
    box = limited_box(box_memory_bytes=160 * MiB, tool_server=True)
    with ToolClient(box.socket_path, timeout=60) as client:
        result = client.call("bash", command="python3 -c \"b = b'x' * (400 << 20)\"", timeout=30)
        assert result["exit_code"] == 137, result
        assert KILLED_NOTE in result["output"]
        assert client.call("bash", command="echo still here")["output"].strip() == "still here"


def test_this_host_reports_which_limits_it_enforces() -> None:
    report = enforced_limits("bwrap")
    assert set(report) == {"memory", "pids", "cpu", "disk", "inodes"}
    cgroups, _ = host_cgroups()
    assert report["memory"].enforced == report["pids"].enforced == (cgroups is not None)
    assert report["disk"].enforced == can_mount()[0]
    assert all(support.detail for support in report.values())
    local = enforced_limits("local")
    assert not any(support.enforced for support in local.values())


def test_apptainer_gets_its_cgroup_flags_where_the_host_has_cgroups() -> None:
    flags = cgroup_options(Limits(box_memory_bytes=512 * MiB, box_pids=100))
    cgroups, _ = host_cgroups()
    if cgroups is None or (os.geteuid() != 0 and cgroups.version != 2):
        assert flags == []
    else:
        assert f"--memory={512 * MiB}" in flags and "--pids-limit=100" in flags


def test_a_box_cgroup_is_left_alone_when_its_record_names_another(
    limited_box: BoxFactory,
) -> None:
    # A tampered record naming a cgroup that is not a box's is never killed or removed.
    box = limited_box()
    parent = os.path.dirname(box.info.cgroup[0])
    kill_cgroup([parent])
    remove_cgroup([parent])
    assert os.path.isdir(parent)
    assert box.alive()


def test_a_box_enters_its_cgroup_before_anything_runs(limited_box: BoxFactory) -> None:
    box = limited_box(box_memory_bytes=300 * MiB, box_pids=100)
    cgroup = box.info.cgroup
    assert cgroup
    main = box.info.pid
    with open(f"/proc/{main}/cgroup") as file:
        assert f"/rollserve/{box.id}" in file.read()
    for directory in cgroup:
        for name, value in (("memory.limit_in_bytes", 300 * MiB), ("pids.max", 100)):
            path = Path(directory, name)
            if path.exists():
                assert int(path.read_text()) == value
    # The host side (this process) is not in it: only the box's processes are.
    members = Path(cgroup[0], "cgroup.procs").read_text().split()
    assert str(main) in members and str(os.getpid()) not in members


def test_where_the_host_refuses_mounts_and_has_no_cgroups_boxes_fall_back(
    bwrap_sandbox: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.boxdisk
    import sandbox.cgroups

    def refuse(target: str, options: str) -> None:
        raise OSError(errno.EPERM, "not allowed here")

    monkeypatch.setattr(sandbox.boxdisk, "_mount_tmpfs", refuse)
    monkeypatch.setattr(sandbox.cgroups, "host_cgroups", lambda: (None, "none in this test"))
    monkeypatch.setenv(ALLOW_UNLIMITED_ENV, "1")  # without it the box would not start
    box = bwrap_sandbox(limits=Limits(disk_bytes=8 * MiB))
    assert isinstance(box, ProcessSandbox)
    assert box.info.disk is None and box.info.cgroup is None
    assert box.workspace == box.state_dir / "workspace"
    box.start(tool_server=False)
    # /tmp is bwrap's own tmpfs, capped at the disk limit; the workspace is on the host.
    result = box.exec(["sh", "-c", "head -c 12M /dev/zero > /tmp/big"])
    assert result.returncode != 0 and "No space left on device" in result.stderr
    assert box.exec(["sh", "-c", "head -c 12M /dev/zero > /workspace/big"]).returncode == 0


def test_a_tree_too_big_to_remove_at_once_is_removed_in_the_background(tmp_path: Path) -> None:
    tree = tmp_path / ".gone-tree"
    for d in range(20):
        (tree / f"d{d}").mkdir(parents=True)
        for f in range(50):
            (tree / f"d{d}" / f"f{f}").write_text("x")
    discard_tree(tree, budget=0.0)  # no time at all here: a helper removes it
    wait_until(lambda: not tree.exists(), 30, "the tree to be removed")
    small = tmp_path / "small"
    (small / "a" / "b").mkdir(parents=True)
    (small / "a" / "b" / "c").write_text("x")
    discard_tree(small)
    assert not small.exists()  # removed before discard_tree returned


def test_on_cgroup_v2_boxes_go_under_the_nearest_ancestor_that_offers_the_controllers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.cgroups
    from sandbox.boxdisk import MountEntry

    # A fake cgroup2 tree: this process in /system.slice/worker.service.
    mount = tmp_path / "cgroup"
    own = mount / "system.slice" / "worker.service"
    own.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu memory pids io\n")
    (mount / "system.slice" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (mount / "system.slice" / "cgroup.procs").write_text("")
    (mount / "system.slice" / "rollserve").mkdir()
    (mount / "system.slice" / "rollserve" / "cgroup.controllers").write_text("cpu memory pids\n")
    table = [MountEntry("/", str(mount), "cgroup2", "rw")]
    monkeypatch.setattr(sandbox.cgroups, "mount_table", lambda: table)
    monkeypatch.setattr(
        sandbox.cgroups, "_own_cgroups", lambda: {"": "/system.slice/worker.service"}
    )
    found, why = sandbox.cgroups._v2_parent()
    assert found is not None, why
    parent = mount / "system.slice" / "rollserve"
    assert found.parents == (str(parent),) and found.cpu
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert sandbox.cgroups.v2_weight(1024) == 100 and sandbox.cgroups.v2_weight(2) == 1
