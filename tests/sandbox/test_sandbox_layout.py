"""The box's filesystem layout: service paths under directories the box gets fresh, and the
minimal root a box on the host's root sees (arguments only; tests/security/test_minimal_root.py
checks the same in real boxes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sandbox
from sandbox.base import SandboxSpec
from sandbox.bwrap import (
    EXTRA_PATHS_ENV,
    MINIMAL_ROOT,
    BubblewrapBackend,
    BubblewrapSandbox,
    Mount,
    filesystem_args,
)


def test_a_service_path_under_tmp_is_bound_over_the_fresh_tmp(tmp_path: Path) -> None:
    # A checkout (and its venv) under /tmp must stay visible: the box's /tmp is a new tmpfs.
    venv = tmp_path / "checkout" / ".venv"
    venv.mkdir(parents=True)
    assert str(venv).startswith("/tmp/")
    args = filesystem_args(None, [Mount(str(venv), str(venv))])
    binds = [
        i for i in range(len(args) - 2) if args[i : i + 3] == ["--ro-bind", str(venv), str(venv)]
    ]
    tmpfs = [i for i in range(len(args) - 1) if args[i : i + 2] == ["--tmpfs", "/tmp"]]
    assert binds and tmpfs and binds[0] > tmpfs[0]


def test_a_service_path_under_tmp_is_bound_over_the_boxs_own_tmp_disk(tmp_path: Path) -> None:
    # With a disk of its own the box's /tmp is a bind, not bwrap's tmpfs: the service's
    # Python below it must still be bound after it, whatever order the mounts came in.
    venv = tmp_path / "checkout" / ".venv"
    disk_tmp = tmp_path / "disk" / "tmp"
    for path in (venv, disk_tmp):
        path.mkdir(parents=True)
    mounts = [Mount(str(venv), str(venv)), Mount(str(disk_tmp), "/tmp", writable=True)]
    args = filesystem_args(None, mounts)
    own_tmp = args.index(str(disk_tmp))
    python = next(
        i for i in range(len(args) - 2) if args[i : i + 3] == ["--ro-bind", str(venv), str(venv)]
    )
    assert args[own_tmp - 1 : own_tmp + 2] == ["--bind", str(disk_tmp), "/tmp"]
    assert python > own_tmp
    # the directories on the way are made traversable (not with the keeper's umask)
    on_the_way = [str(p) for p in reversed(venv.parents) if str(p).startswith("/tmp/")]
    for directory in on_the_way:
        made = args.index(directory)
        assert args[made - 3 : made + 1] == ["--perms", "0755", "--dir", directory]
        assert own_tmp < made < python
    assert ["--tmpfs", "/tmp"] not in [args[i : i + 2] for i in range(len(args) - 1)]


def test_a_service_path_visible_anyway_is_not_bound_again() -> None:
    args = filesystem_args(None, [Mount("/usr/lib", "/usr/lib")])
    assert args[-3:] != ["--ro-bind", "/usr/lib", "/usr/lib"]
    assert "/usr/lib" not in [args[i + 2] for i in range(len(args) - 2) if args[i] == "--ro-bind"]


# The minimal root: what a box on the host's root sees of it.


def _pairs(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


def _singles(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def _made(args: list[str]) -> set[str]:
    """Every path the arguments put in the box."""
    made = {inside for _, inside in _pairs(args, "--ro-bind") + _pairs(args, "--bind")}
    made.update(inside for _, inside in _pairs(args, "--symlink"))
    for flag in ("--dir", "--tmpfs", "--dev", "--proc"):
        made.update(_singles(args, flag))
    return made


def _host_root(path: Path) -> Path:
    """A small root: merged /usr, an /etc with secrets beside what programs read, data."""
    for directory in (
        "usr/bin",
        "usr/lib",
        "etc/ssl/certs",
        "etc/ssl/private",
        "etc/xdg/pip",
        "etc/python3.11",
        "var/log",
        "srv/data",
        "opt/app",
        "home/me",
        "root",
        "work/project/results",
        "work/project/sandbox",
        "tmp",
        "proc",
        "dev",
    ):
        (path / directory).mkdir(parents=True)  # fmt: skip
    for name in ("bin", "lib", "sbin"):
        (path / name).symlink_to(f"usr/{name if name != 'sbin' else 'bin'}")
    for name in ("passwd", "group", "shadow", "resolv.conf", "ssl/openssl.cnf", "pip.conf"):
        (path / "etc" / name).write_text("")
    (path / "etc" / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
    return path


EXPOSE = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/etc/passwd", "/etc/group",
          "/etc/localtime", "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/xdg/pip",
          "/etc/python3*", "/etc/pip.conf"]  # fmt: skip


def test_only_the_exposed_paths_of_the_root_are_in_the_box(tmp_path: Path) -> None:
    root = _host_root(tmp_path / "root")
    args = filesystem_args(str(root), [Mount("/srv/ws", "/workspace", True)], expose=EXPOSE)
    top = {p for p in _made(args) if p.count("/") == 1}
    assert top == {"/usr", "/bin", "/sbin", "/lib", "/etc", "/dev", "/proc", "/tmp", "/workspace"}
    etc = {p for p in _made(args) if p.startswith("/etc/")}
    assert etc == {"/etc/passwd", "/etc/group", "/etc/localtime", "/etc/ssl", "/etc/ssl/certs",
                   "/etc/ssl/openssl.cnf", "/etc/xdg", "/etc/xdg/pip", "/etc/python3.11",
                   "/etc/pip.conf"}  # fmt: skip
    # Symlinks stay symlinks; a directory seen in part is made, with its host mode.
    links = dict((inside, target) for target, inside in _pairs(args, "--symlink"))
    assert links == {"/bin": "usr/bin", "/lib": "usr/lib", "/sbin": "usr/bin",
                     "/etc/localtime": "/usr/share/zoneinfo/Etc/UTC"}  # fmt: skip
    assert {"/etc", "/etc/ssl", "/etc/xdg"} <= set(_singles(args, "--dir"))
    assert (str(root / "usr"), "/usr") in _pairs(args, "--ro-bind")


def test_without_expose_the_whole_root_is_in_the_box(tmp_path: Path) -> None:
    root = _host_root(tmp_path / "root")
    args = filesystem_args(str(root), [])
    ro = dict(_pairs(args, "--ro-bind"))
    assert ro[str(root / "etc")] == "/etc" and ro[str(root / "srv")] == "/srv"


def test_the_minimal_root_of_this_host_leaves_out_what_agents_need_not_see() -> None:
    args = filesystem_args(None, [], expose=MINIMAL_ROOT)
    made = _made(args)
    top = {p for p in made if p.count("/") == 1}
    assert top <= {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                   "/dev", "/proc", "/tmp"}  # fmt: skip
    assert {"/usr", "/bin", "/etc"} <= top
    for name in ("bin", "lib", "sbin"):
        if os.path.islink(f"/{name}"):
            assert (os.readlink(f"/{name}"), f"/{name}") in _pairs(args, "--symlink")
    assert not {"/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/ssl/private"} & made
    assert ("/etc", "/etc") not in _pairs(args, "--ro-bind")
    assert "/etc/passwd" in made and "/etc/ld.so.cache" in made


def test_a_mount_under_a_directory_the_box_does_not_see_gets_empty_parents() -> None:
    python = "/root/.pyenv/versions/3.11.7"
    args = filesystem_args(None, [Mount(python, python)], expose=MINIMAL_ROOT, hidden=["/root"])
    # Nothing of /root but the way to the mount: no tmpfs needed to hide the rest.
    assert "/root" not in _singles(args, "--tmpfs")
    assert [d for d in _singles(args, "--dir") if d.startswith("/root")] == [
        "/root",
        "/root/.pyenv",
        "/root/.pyenv/versions",
    ]
    assert _pairs(args, "--ro-bind")[-1] == (python, python)


def test_a_path_bound_onto_itself_is_bound_unless_the_box_sees_it_anyway(
    visible_host_dir: Path,
) -> None:
    project = visible_host_dir / "project"
    (project / "sandbox").mkdir(parents=True)
    (project / "results").mkdir()
    mounts = [
        Mount("/usr/lib", "/usr/lib"),
        Mount(str(project / "sandbox"), str(project / "sandbox")),
    ]
    args = filesystem_args(None, mounts, expose=MINIMAL_ROOT)
    ro = _pairs(args, "--ro-bind")
    assert ("/usr/lib", "/usr/lib") not in ro
    assert (str(project / "sandbox"), str(project / "sandbox")) in ro
    # The directories on the way are made empty: nothing else of the project is there.
    assert str(project / "results") not in _made(args)
    assert [str(p) for p in reversed(project.parents) if str(p) != "/"] + [str(project)] == [
        d for d in _singles(args, "--dir") if not d.startswith("/etc")
    ]


def test_a_mount_point_in_a_directory_seen_in_part_is_made_there(tmp_path: Path) -> None:
    root = _host_root(tmp_path / "root")
    args = filesystem_args(str(root), [Mount("/host/resolv", "/etc/resolv.conf")], expose=EXPOSE)
    assert ("/host/resolv", "/etc/resolv.conf") in _pairs(args, "--ro-bind")
    assert (str(root / "etc" / "resolv.conf"), "/etc/resolv.conf") not in _pairs(args, "--ro-bind")
    assert "/etc/shadow" not in _made(args)


def test_a_hidden_path_is_covered_where_the_box_sees_it_whole_only(
    visible_host_dir: Path,
) -> None:
    state_root = visible_host_dir / "data" / "state"
    state_root.mkdir(parents=True)
    data = str(visible_host_dir / "data")
    shown = filesystem_args(None, [], expose=["/usr", data], hidden=[str(state_root)])
    assert (data, data) in _pairs(shown, "--ro-bind")
    assert str(state_root) in _singles(shown, "--tmpfs")
    # On the way to an exposed path, a hidden directory shows only that path: nothing to cover.
    inner = state_root / "exposed"
    inner.mkdir()
    passing = filesystem_args(None, [], expose=["/usr", str(inner)], hidden=[str(state_root)])
    assert str(state_root) not in _singles(passing, "--tmpfs")
    assert (str(inner), str(inner)) in _pairs(passing, "--ro-bind")


def test_a_path_exposed_under_tmp_is_bound_over_the_fresh_tmp(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    args = filesystem_args(None, [], expose=["/usr", str(shared)])
    bind = args.index(str(shared))
    assert args[bind - 1 : bind + 2] == ["--ro-bind", str(shared), str(shared)]
    assert bind > args.index("/tmp")


def test_the_backend_adds_extra_paths_and_their_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    link = tmp_path / "link"
    link.symlink_to(data)
    backend = BubblewrapBackend(extra_paths=[str(link)])
    assert backend.root_paths[: len(MINIMAL_ROOT)] == MINIMAL_ROOT
    assert backend.root_paths[len(MINIMAL_ROOT) :] == (str(link), str(data))
    monkeypatch.setenv(EXTRA_PATHS_ENV, f"{data}, /srv/a:/srv/b")
    assert BubblewrapBackend().root_paths[len(MINIMAL_ROOT) :] == (str(data), "/srv/a", "/srv/b")
    with pytest.raises(ValueError, match="must be absolute"):
        BubblewrapBackend(extra_paths=["relative/path"])


def test_a_box_on_the_host_root_is_laid_out_from_the_minimal_root(
    state_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = tmp_path / "rootfs"
    (given / "srv").mkdir(parents=True)
    backend = BubblewrapBackend(extra_paths=[])
    monkeypatch.setattr(backend, "available", lambda: (True, ""))
    on_host = backend.create(SandboxSpec(job_id="layout-host"), state_root)
    own_root = backend.create(SandboxSpec(job_id="layout-own", root=str(given)), state_root)
    try:
        assert isinstance(on_host, BubblewrapSandbox) and isinstance(own_root, BubblewrapSandbox)
        made = _made(on_host._filesystem)
        checkout = Path(sandbox.__file__).resolve().parent.parent
        assert str(Path(sandbox.__file__).resolve().parent) in made
        assert (str(checkout), str(checkout)) not in _pairs(on_host._filesystem, "--ro-bind")
        assert not {str(checkout / "results"), str(checkout / ".rollserve")} & made
        assert not {"/srv", "/opt", "/var", "/mnt", "/media", "/home", "/run"} & made
        assert str(state_root) not in made
        # A root of its own is seen whole, as before.
        assert (str(given / "srv"), "/srv") in _pairs(own_root._filesystem, "--ro-bind")
    finally:
        on_host.stop()
        own_root.stop()
