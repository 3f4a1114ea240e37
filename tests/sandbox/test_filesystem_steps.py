"""The steps of `filesystem_args`, each on its own: what a reviewer checks one by one to know
what a box sees (arguments only; test_sandbox_layout.py checks the whole, and
tests/security the same in real boxes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.base import SandboxError
from sandbox.bwrap import (
    Mount,
    _covers_in_mounts,
    _fresh_args,
    _mount_args,
    _mount_point_dirs,
    _needed_mounts,
    _root_args,
    _View,
    _with_exposed_fresh,
    hidden_covers,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An image root: /usr/bin, /etc, /home/user, /srv/data/state, /bin -> usr/bin."""
    base = tmp_path / "root"
    for directory in ("usr/bin", "etc", "home/user", "srv/data/state"):
        (base / directory).mkdir(parents=True)
    (base / "etc" / "hosts").write_text("")
    (base / "bin").symlink_to("usr/bin")
    return base


def view(root: Path, expose: list[str] | None = None) -> _View:
    return _View(str(root), expose)


def test_exposed_paths_under_fresh_directories_become_binds(root: Path) -> None:
    (root / "tmp" / "shared").mkdir(parents=True)
    mounts = _with_exposed_fresh(view(root, ["/usr", "/tmp/shared"]), [])
    assert mounts == [Mount(str(root / "tmp" / "shared"), "/tmp/shared")]


def test_hidden_host_paths_are_covered_where_an_image_root_holds_them(root: Path) -> None:
    hidden = [str(root / "home"), str(root / "srv" / "data"), str(root / "srv" / "data" / "state")]
    assert hidden_covers(view(root), hidden) == ["/home", "/srv/data"]  # outermost only


def test_hidden_host_paths_outside_an_image_root_need_no_cover(root: Path) -> None:
    assert hidden_covers(view(root), ["/home", "/root", "/run"]) == []


def test_on_the_hosts_root_hidden_paths_are_covered_where_seen_whole() -> None:
    host = _View("/", None)
    assert hidden_covers(host, ["/home", "/root", "/tmp/x"]) == ["/home", "/root"]
    minimal = _View("/", ["/usr"])
    assert hidden_covers(minimal, ["/home", "/root"]) == []


def test_a_self_bind_of_a_visible_path_is_not_made_twice() -> None:
    host = _View("/", ["/usr"])
    mounts = [Mount("/usr/lib", "/usr/lib"), Mount("/srv/ws", "/workspace", True)]
    assert _needed_mounts(host, mounts, []) == [Mount("/srv/ws", "/workspace", True)]


def test_mount_points_get_their_directories_rebuilt_or_made(root: Path) -> None:
    expand, create = _mount_point_dirs(view(root), [Mount("/srv/ws", "/workspace/sub", True)], [])
    assert (expand, create) == (set(), ["/workspace"])
    expand, create = _mount_point_dirs(view(root), [Mount("/x", "/usr/lib/python")], [])
    assert (expand, create) == ({"/usr"}, ["/usr/lib"])


def test_a_mount_point_under_a_symlink_is_refused(root: Path) -> None:
    with pytest.raises(SandboxError, match="/bin is not a directory"):
        _mount_point_dirs(view(root), [Mount("/x", "/bin/x/y")], [])


def test_the_root_is_bound_entry_by_entry_leaving_out_covers_and_mount_points(root: Path) -> None:
    args = _root_args(view(root), ["/home"], {"/etc/hosts"}, {"/", "/etc"})
    assert args[args.index("/bin") - 2 : args.index("/bin") + 1] == ["--symlink", "usr/bin", "/bin"]
    assert "/home" not in args and str(root / "etc" / "hosts") not in args
    assert ["--ro-bind", str(root / "usr"), "/usr"] == args[args.index("/usr") - 2 :][:3]
    assert args[args.index("/etc") - 1] == "--dir"


def test_fresh_directories_are_capped_unless_the_boxs_disk_is_bound() -> None:
    assert _fresh_args(set(), 1024) == [
        "--dev", "/dev", "--proc", "/proc",
        "--perms", "1777", "--size", "1024", "--tmpfs", "/tmp",
        "--perms", "1777", "--size", "1024", "--tmpfs", "/dev/shm",
    ]  # fmt: skip
    assert "--tmpfs" not in _fresh_args({"/tmp", "/dev/shm"}, 1024)


def test_binds_come_outermost_first_with_traversable_parents_in_fresh_dirs() -> None:
    mounts = [Mount("/venv", "/tmp/a/venv"), Mount("/disk/tmp", "/tmp", True)]
    args = _mount_args(mounts, {m.inside for m in mounts}, set())
    assert args == [
        "--bind", "/disk/tmp", "/tmp",
        "--perms", "0755", "--dir", "/tmp/a",
        "--ro-bind", "/venv", "/tmp/a/venv",
    ]  # fmt: skip


def test_a_hidden_path_a_bind_brings_back_is_covered_where_it_appears() -> None:
    mounts = [Mount("/srv/checkout", "/rollserve/source")]
    found = _covers_in_mounts(["/srv/checkout/.rollserve"], mounts, set())
    assert found == ["/rollserve/source/.rollserve"]
    assert _covers_in_mounts(["/srv/checkout"], mounts, set()) == []
