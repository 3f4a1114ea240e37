"""A bubblewrap box on the host's root sees only the minimal root: the system's programs and
libraries, the parts of /etc they read, the service's Python and the `sandbox` package, its
workspace and fresh /tmp, /dev and /proc. Shown in real boxes, with the state root outside
/tmp (where the box would not see it anyway)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandbox
from sandbox.base import Sandbox
from sandbox.bwrap import MINIMAL_ROOT, BubblewrapBackend, _exposed
from sandbox.startup import service_paths
from sandbox.statedir import remove_tree
from tests.support.sandbox import SandboxFactory, sandbox_factory

CHECKOUT = Path(sandbox.__file__).resolve().parent.parent
"""The directory holding the service's packages (a checkout: results, state, logs)."""


@pytest.fixture
def outside_tmp_state_root() -> Iterator[Path]:
    """A short state root the box would see if it saw the host's /var."""
    root = Path(tempfile.mkdtemp(prefix="rs-", dir="/var/tmp"))
    yield root
    remove_tree(root)


@pytest.fixture
def box_of(
    bwrap_backend: BubblewrapBackend, outside_tmp_state_root: Path
) -> Iterator[SandboxFactory]:
    yield from sandbox_factory(BubblewrapBackend(extra_paths=[]), outside_tmp_state_root)


def listing(box: Sandbox, path: str) -> set[str]:
    result = box.exec(["ls", "-A", path])
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_the_box_root_holds_only_the_minimal_root(box_of: SandboxFactory) -> None:
    exposed = _exposed("/", MINIMAL_ROOT)
    service = {str(p).split("/")[1] for p in service_paths()}
    expected = {e.split("/")[1] for e in exposed} | service | {"dev", "proc", "tmp", "workspace"}
    assert listing(box_of(), "/") == expected
    assert {"usr", "bin", "etc"} <= expected


def test_etc_holds_only_what_programs_read(box_of: SandboxFactory) -> None:
    expected = {e.split("/")[2] for e in _exposed("/", MINIMAL_ROOT) if e.startswith("/etc/")}
    seen = listing(box_of(), "/etc")
    assert seen == expected
    assert {"passwd", "group", "nsswitch.conf", "ld.so.cache"} <= seen
    assert not {"shadow", "gshadow", "ssh", "resolv.conf", "hostname"} & seen


def test_merged_usr_symlinks_stay_symlinks(box_of: SandboxFactory) -> None:
    box = box_of()
    for name in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink(f"/{name}"):
            result = box.exec(["readlink", f"/{name}"])
            assert result.stdout.strip() == os.readlink(f"/{name}")


def test_the_project_and_other_host_trees_are_not_there(box_of: SandboxFactory) -> None:
    box = box_of()
    # Of the checkout, only the service's own parts (the sandbox package, a venv in it).
    own = {p.relative_to(CHECKOUT).parts[0] for p in service_paths() if CHECKOUT in p.parents}
    assert listing(box, str(CHECKOUT)) == own
    assert "sandbox" in own
    absent = [CHECKOUT / name for name in ("results", ".rollserve", ".env", "core", "README.md")]
    absent += [Path(p) for p in ("/srv", "/opt", "/var", "/var/log", "/mnt", "/media")]
    absent += [Path(p) for p in ("/home", "/run", "/sys", "/boot", "/etc/shadow", "/etc/ssh")]
    script = "".join(f"test -e {p} && echo {p};" for p in absent) + "true"
    result = box.exec(["sh", "-c", script])
    assert result.returncode == 0 and result.stdout == "", result


def test_the_state_root_and_another_box_are_not_there(
    box_of: SandboxFactory, outside_tmp_state_root: Path
) -> None:
    neighbour = box_of()
    (neighbour.workspace / "answer.txt").write_text("the neighbour's answer\n")
    box = box_of()
    for path in (outside_tmp_state_root, neighbour.state_dir, neighbour.workspace / "answer.txt"):
        result = box.exec(["cat", str(path)])
        assert "No such file or directory" in result.stderr, path
    # Its own workspace is there, at /workspace only.
    assert box.exec(["ls", "-A", "/workspace"]).returncode == 0


def test_common_tools_work(box_of: SandboxFactory) -> None:
    box = box_of()
    commands = {
        "bash": ["bash", "-c", "echo $((6 * 7))"],
        "git": ["git", "--version"],
        "python3": ["python3", "-c", "import json, ssl; ssl.create_default_context(); print(1)"],
        "ls": ["ls", "-l", "/usr/bin/env"],
        "ps": ["ps", "-ef"],
        "awk": ["sh", "-c", "echo a b | awk '{print $2}'"],
        "sed": ["sh", "-c", "echo x | sed s/x/y/"],
        "grep": ["sh", "-c", "grep -c root /etc/passwd"],
        "env": ["env"],
    }
    if os.path.exists("/usr/bin/pip"):
        commands["pip"] = ["pip", "--version"]
    for name, argv in commands.items():
        result = box.exec(argv)
        assert result.returncode == 0, f"{name}: {result}"
    # A git repository in the workspace, committed to.
    script = (
        "git init -q repo && cd repo && echo hi > f && git add f && "
        "git -c user.name=a -c user.email=a@b commit -qm one && git log --oneline | wc -l"
    )
    result = box.exec(["bash", "-c", script])
    assert result.stdout.strip() == "1", result


def test_the_services_python_imports_the_sandbox_package_and_nothing_else_of_it(
    box_of: SandboxFactory,
) -> None:
    box = box_of()
    code = "import sandbox.toolserver.server, sandbox.startup; print(sandbox.__file__)"
    result = box.exec([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sandbox.__file__
    assert box.exec([sys.executable, "-c", "import core.settings"]).returncode != 0


def test_an_extra_path_is_seen_read_only(
    bwrap_backend: BubblewrapBackend, outside_tmp_state_root: Path, visible_host_dir: Path
) -> None:
    (visible_host_dir / "data.txt").write_text("shared data\n")
    visible_host_dir.chmod(0o755)  # readable by the box's uid
    link = Path(tempfile.mkdtemp(prefix="rs-link-", dir="/var/tmp")) / "data"
    link.symlink_to(visible_host_dir)
    try:
        backend = BubblewrapBackend(extra_paths=[str(link)])
        for make in sandbox_factory(backend, outside_tmp_state_root):
            box = make()
            result = box.exec(["sh", "-c", f"cat {link}/data.txt; touch {link}/new"])
            assert result.stdout == "shared data\n"
            assert "Read-only file system" in result.stderr
            assert box.exec(["ls", "/var"]).stdout.split() == ["tmp"]
    finally:
        shutil.rmtree(link.parent)
