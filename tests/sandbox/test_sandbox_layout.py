"""The box's filesystem layout: service paths under directories the box gets fresh."""

from __future__ import annotations

from pathlib import Path

from sandbox.bwrap import Mount, filesystem_args


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


def test_a_service_path_visible_anyway_is_not_bound_again() -> None:
    args = filesystem_args(None, [Mount("/usr/lib", "/usr/lib")])
    assert args[-3:] != ["--ro-bind", "/usr/lib", "/usr/lib"]
    assert "/usr/lib" not in [args[i + 2] for i in range(len(args) - 2) if args[i] == "--ro-bind"]
