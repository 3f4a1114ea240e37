"""The bubblewrap backend: lifecycle, workspace, environment, roots, binds, and the layout of
the box's filesystem."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import sandbox
from sandbox.backends import get_backend
from sandbox.base import Bind, SandboxError, SandboxSpec
from sandbox.bwrap import BubblewrapBackend, BubblewrapSandbox, Mount, filesystem_args
from sandbox.procs import LABEL_ID, LABEL_JOB
from sandbox.startup import service_paths
from tests.support.wait import wait_until

if TYPE_CHECKING:
    from tests.support.sandbox import SandboxFactory


JobProcesses = Callable[[str], list[int]]


def test_available_when_bubblewrap_can_make_a_box(bwrap_backend: BubblewrapBackend) -> None:
    assert bwrap_backend.available() == (True, "")


@pytest.mark.skipif(
    shutil.which("singularity") is not None, reason="Apptainer is installed: auto picks it"
)
def test_auto_passes_over_apptainer_saying_why_and_picks_bubblewrap(
    bwrap_backend: BubblewrapBackend, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="sandbox.backends"):
        assert get_backend("auto").name == "bwrap"
    assert "sandbox backend apptainer passed over: neither apptainer nor singularity" in (
        caplog.text
    )


def test_backends_are_named_and_an_unknown_name_lists_them() -> None:
    assert [get_backend(name).name for name in ("bwrap", "apptainer", "local")] == [
        "bwrap",
        "apptainer",
        "local",
    ]
    with pytest.raises(ValueError, match="choose one of auto, apptainer, bwrap, local"):
        get_backend("docker")


def test_the_probe_binds_no_whole_tree_and_a_yes_is_kept(
    bwrap_backend: BubblewrapBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = BubblewrapBackend()  # a fresh object: its answer is not asked yet
    probes: list[list[str]] = []
    run = subprocess.run

    def spy(argv: list[str], **kwargs: Any) -> Any:
        probes.append(argv)
        return run(argv, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    assert backend.available() == (True, "")
    [probe] = probes
    bound = [probe[i + 1] for i, arg in enumerate(probe) if arg.startswith("--ro-bind")]
    assert "/" not in bound and "/usr" in bound  # a mount going away under / cannot fail it
    assert backend.available() == (True, "") and len(probes) == 1


def test_not_available_says_why_without_the_binary() -> None:
    ok, why = BubblewrapBackend(executable="/nonexistent/bwrap").available()
    assert not ok
    assert "bubblewrap is not installed" in why


def test_start_makes_a_live_box_and_stop_ends_it_twice_over(
    bwrap_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    box = bwrap_sandbox()
    assert not box.alive()
    box.start(tool_server=False)
    assert box.alive()
    box.start(tool_server=False)  # idempotent while running
    assert box.alive()
    assert job_processes(box.job_id)
    box.stop()
    box.stop()
    assert not box.alive()
    assert not box.state_dir.exists()
    assert job_processes(box.job_id) == []


def test_a_stopped_sandbox_cannot_start_or_exec_again(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=False)
    box.stop()
    with pytest.raises(SandboxError, match="stopped"):
        box.start(tool_server=False)
    with pytest.raises(SandboxError, match="stopped"):
        box.exec(["true"])


def test_a_box_that_cannot_come_up_fails_start_with_its_reason(
    bwrap_sandbox: SandboxFactory,
) -> None:
    box = bwrap_sandbox(workdir="/no/such/dir")
    with pytest.raises(SandboxError, match="Can't chdir to /no/such/dir"):
        box.start(tool_server=False)
    assert not box.state_dir.exists()


def test_exec_sees_host_files_in_the_workspace_and_the_host_sees_its_files(
    bwrap_sandbox: SandboxFactory,
) -> None:
    box = bwrap_sandbox()
    (box.workspace / "from_host.txt").write_text("written on the host\n")
    result = box.exec(["sh", "-c", "pwd; cat from_host.txt; echo made inside > from_box.txt"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "/workspace\nwritten on the host\n"
    assert (box.workspace / "from_box.txt").read_text() == "made inside\n"


def test_exec_works_without_start_and_while_the_box_runs(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox()
    assert box.exec(["echo", "before"]).stdout == "before\n"
    box.start(tool_server=False)
    assert box.exec(["echo", "during"]).stdout == "during\n"


def test_env_of_the_spec_and_of_the_call_pass_through_and_the_host_env_does_not(
    bwrap_sandbox: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSERVE_TEST_HOST_SECRET", "hunter2")
    box = bwrap_sandbox(env={"FROM_SPEC": "spec, with 'quotes'", "SHARED": "spec"})
    result = box.exec(["env"], env={"FROM_CALL": "call", "SHARED": "call"})
    env = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert env["FROM_SPEC"] == "spec, with 'quotes'"
    assert env["FROM_CALL"] == "call"
    assert env["SHARED"] == "call"
    assert env[LABEL_ID] == box.id
    assert env["HOME"] == "/tmp"
    assert "ROLLSERVE_TEST_HOST_SECRET" not in env


def test_the_job_label_cannot_be_overridden_by_the_spec(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox(env={LABEL_ID: "someone-else"})
    assert box.exec(["printenv", LABEL_ID]).stdout.strip() == box.id


def test_input_reaches_the_command_on_stdin(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox()
    result = box.exec(["wc", "-c"], input=b"x" * 300_000)
    assert result.stdout.strip() == "300000"


def test_a_missing_command_exits_127_and_says_so(bwrap_sandbox: SandboxFactory) -> None:
    result = bwrap_sandbox().exec(["no-such-command-here"])
    assert result.returncode == 127
    assert "cannot run no-such-command-here" in result.stderr
    assert result.killed_by is None


def test_output_beyond_the_cap_is_cut_with_a_marker(bwrap_sandbox: SandboxFactory) -> None:
    result = bwrap_sandbox().exec(["head", "-c", "100000", "/dev/zero"], max_output=1000)
    assert result.stdout.startswith("\0" * 1000)
    assert "[... 99000 more bytes of output cut]" in result.stdout


def test_a_given_workspace_is_used_and_kept_after_stop(
    bwrap_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    workspace = tmp_path / "repo"
    workspace.mkdir()
    (workspace / "README").write_text("a repository\n")
    owner = (workspace.stat().st_uid, workspace.stat().st_gid)
    box = bwrap_sandbox(workspace=workspace)
    assert box.workspace == workspace.resolve()
    result = box.exec(["sh", "-c", "cat README && echo patch > fix.diff"])
    assert result.stdout == "a repository\n", result.stderr
    box.stop()
    assert (workspace / "fix.diff").read_text() == "patch\n"
    # Handed back to its owner when the box ran under a uid of its own.
    assert {(p.stat().st_uid, p.stat().st_gid) for p in [workspace, *workspace.iterdir()]} == {
        owner
    }


def test_binds_are_visible_read_only_unless_asked_writable(
    bwrap_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "input.txt").write_text("dataset\n")
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    box = bwrap_sandbox(
        binds=[Bind(data, "/data"), Bind(out, "/opt/rollserve-test/out", read_only=False)]
    )
    result = box.exec(
        ["sh", "-c", "cat /data/input.txt; echo x > /data/new; echo y > /opt/rollserve-test/out/o"]
    )
    assert result.stdout == "dataset\n"
    assert "Read-only file system" in result.stderr
    assert not (data / "new").exists()
    assert (out / "o").read_text() == "y\n"


def _minimal_root(path: Path) -> Path:
    """A root filesystem with only dash and the C library the service's Python needs."""
    libs = ["libc.so.6", "libm.so.6"]
    (path / "bin").mkdir(parents=True)
    (path / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (path / "lib64").mkdir()
    (path / "etc").mkdir()
    (path / "root").mkdir(mode=0o700)
    shutil.copy2(os.path.realpath("/bin/sh"), path / "bin" / "sh")
    for lib in libs:
        shutil.copy2(f"/lib/x86_64-linux-gnu/{lib}", path / "lib" / "x86_64-linux-gnu" / lib)
    shutil.copy2("/lib64/ld-linux-x86-64.so.2", path / "lib64" / "ld-linux-x86-64.so.2")
    (path / "etc" / "marker").write_text("the custom root\n")
    return path


@pytest.mark.skipif(
    not Path("/lib64/ld-linux-x86-64.so.2").exists(), reason="needs an x86-64 glibc host"
)
def test_a_given_root_filesystem_is_the_boxs_root(
    bwrap_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    root = _minimal_root(tmp_path / "rootfs")
    box = bwrap_sandbox(root=str(root))
    script = "read line < /etc/marker; echo $line; test -e /usr/bin/env || echo no-host-usr"
    result = box.exec(["/bin/sh", "-c", script])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the custom root\nno-host-usr\n"
    # The service's interpreter came along (the launcher ran on it), the root did not change.
    assert sorted(p.name for p in root.iterdir()) == ["bin", "etc", "lib", "lib64", "root"]
    assert not any((root / "root").iterdir())


def test_the_services_python_and_packages_run_inside(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox()
    code = "import sys, sandbox.base; print(sys.prefix)"
    result = box.exec([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sys.prefix


def test_a_state_root_too_long_for_a_unix_socket_is_refused(
    bwrap_backend: BubblewrapBackend, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    box = bwrap_backend.create(SandboxSpec(job_id="long"), deep)
    try:
        with pytest.raises(SandboxError, match="longer than a Unix socket allows"):
            box.start(tool_server=True)
    finally:
        box.stop()


@pytest.mark.usefixtures("toolserver_available")
def test_start_with_the_tool_server_returns_when_its_socket_accepts(
    bwrap_sandbox: SandboxFactory,
) -> None:
    box = bwrap_sandbox()
    box.start(tool_server=True, timeout=30)
    assert box.alive()
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(box.socket_path))
    box.stop()
    assert not box.alive()


def test_a_stop_while_start_waits_for_the_tool_server_ends_the_start(
    bwrap_sandbox: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tool server that never listens.
    monkeypatch.setattr("sandbox.process.toolserver_argv", lambda *args: ["sleep", "1000"])
    box = bwrap_sandbox()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            box.start(tool_server=True, timeout=60)
        except BaseException as exc:
            failures.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    wait_until(box.alive, 10, "the box to come up", interval=0.01)
    box.stop()
    starting.join(10)
    assert not starting.is_alive(), "the start did not give up when the box was stopped"
    assert len(failures) == 1 and isinstance(failures[0], SandboxError)


def test_start_without_tool_server_then_stop_leaves_nothing(
    bwrap_sandbox: SandboxFactory, job_processes: JobProcesses
) -> None:
    # How fast a box starts and stops is measured in bench/, not asserted here.
    box = bwrap_sandbox()
    box.start(tool_server=False)
    assert box.alive() and job_processes(box.job_id)
    box.stop()
    assert not box.alive() and job_processes(box.job_id) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own per box is the root mode")
def test_as_root_each_box_runs_as_a_uid_of_its_own(bwrap_sandbox: SandboxFactory) -> None:
    first, second = bwrap_sandbox(), bwrap_sandbox()
    assert isinstance(first, BubblewrapSandbox) and isinstance(second, BubblewrapSandbox)
    uids = {int(box.exec(["id", "-u"]).stdout) for box in (first, second)}
    assert uids == {first.info.uid, second.info.uid}
    assert len(uids) == 2 and 0 not in uids


# The filesystem layout, without running bubblewrap.


def _pairs(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


def _singles(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_host_root_is_bound_entry_by_entry_with_fresh_proc_dev_and_tmp() -> None:
    args = filesystem_args(None, [Mount("/srv/ws", "/workspace", writable=True)])
    ro = dict(_pairs(args, "--ro-bind"))
    assert ro["/usr"] == "/usr" and ro["/etc"] == "/etc"
    assert "/proc" not in ro and "/tmp" not in ro and "/dev" not in ro
    assert _pairs(args, "--bind") == [("/srv/ws", "/workspace")]
    assert "/tmp" in _singles(args, "--tmpfs") and "/dev/shm" in _singles(args, "--tmpfs")


def test_hidden_host_directories_become_empty_and_the_services_python_is_rebound() -> None:
    python = "/root/.pyenv/versions/3.11.7"
    args = filesystem_args(None, [Mount(python, python)], hidden=["/root", "/home"])
    assert ("/root", "/root") not in _pairs(args, "--ro-bind")
    assert {"/root", "/home"} <= set(_singles(args, "--tmpfs"))
    # Created traversable (bwrap's own parents would be 0700), then bound read-only.
    dirs = _singles(args, "--dir")
    assert dirs == ["/root/.pyenv", "/root/.pyenv/versions"]
    assert _pairs(args, "--ro-bind")[-1] == (python, python)
    assert args.index("--tmpfs") < args.index("/root/.pyenv")


def test_a_visible_path_bound_onto_itself_read_only_is_not_bound_again() -> None:
    args = filesystem_args(None, [Mount("/usr/lib", "/usr/lib")])
    assert ("/usr/lib", "/usr/lib") not in _pairs(args, "--ro-bind")


def test_a_mount_point_missing_in_a_custom_root_rebuilds_its_parents(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "bin").mkdir()
    (root / "usr" / "lib" / "libc.so").write_text("")
    (root / "etc").mkdir()
    args = filesystem_args(str(root), [Mount("/srv/venv", "/usr/lib/venv")])
    # /usr is rebuilt in tmpfs from its entries so /usr/lib can be, and /usr/lib/venv made.
    assert "/usr" in _singles(args, "--dir") and "/usr/lib" in _singles(args, "--dir")
    ro = dict(_pairs(args, "--ro-bind"))
    assert ro[str(root / "usr" / "bin")] == "/usr/bin"
    assert ro[str(root / "usr" / "lib" / "libc.so")] == "/usr/lib/libc.so"
    assert ro[str(root / "etc")] == "/etc"
    assert ro["/srv/venv"] == "/usr/lib/venv"


def test_a_hidden_path_a_mount_brings_into_view_is_covered_where_it_appears(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    source = tmp_path / "src"
    (source / "state").mkdir(parents=True)
    args = filesystem_args(
        str(root), [Mount(str(source), "/opt/src")], hidden=[str(source / "state")]
    )
    assert args[-1] == "/opt/src/state" and args[-2] == "--tmpfs"


def test_a_hidden_path_is_covered_everywhere_a_bind_shows_it(tmp_path: Path) -> None:
    state_root = tmp_path / "work" / "state"
    state_root.mkdir(parents=True)
    args = filesystem_args(
        None, [Mount(str(tmp_path / "work"), "/mnt/work")], hidden=[str(state_root)]
    )
    assert "/mnt/work/state" in _singles(args, "--tmpfs")


def test_a_mount_under_a_symlink_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    with pytest.raises(SandboxError, match="not a directory"):
        filesystem_args(str(root), [Mount("/x", "/bin/x/y")])


def test_the_service_paths_cover_the_interpreter_and_the_sandbox_package_alone() -> None:
    paths = service_paths()
    assert any(Path(sys.prefix).resolve() == p or p in Path(sys.prefix).resolve().parents
               for p in paths)  # fmt: skip
    package = Path(sandbox.__file__).resolve().parent
    assert any(p == package or p in package.parents for p in paths)
    # Not the checkout holding it (results, state, logs, the other packages).
    checkout = package.parent
    assert not any(p == checkout or p in checkout.parents for p in paths)


def test_a_system_pythons_prefix_is_not_bound_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("prefix", "base_prefix", "exec_prefix"):
        monkeypatch.setattr(sys, name, "/usr")
    monkeypatch.setattr(sys, "executable", os.path.realpath("/bin/sh"))
    paths = service_paths()
    assert Path("/usr") not in paths and Path("/") not in paths
    assert Path(os.path.realpath("/bin/sh")) in paths


def test_bwrap_runs_from_a_clean_host_environment(
    state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host-side bwrap process gets only PATH, LANG and the labels.
    monkeypatch.setenv("ROLLSERVE_TEST_HOST_SECRET", "hunter2")
    backend = BubblewrapBackend()
    backend.available = lambda: (True, "")  # type: ignore[method-assign]
    box = backend.create(SandboxSpec(job_id="env-check"), state_root)
    try:
        argv, env = box._host_process(["true"], {"A": "1"}, None)
        assert set(env) == {"PATH", "LANG", LABEL_ID, LABEL_JOB}
        after = argv.index("--clearenv") + 1
        assert argv[after : after + 3] == ["--setenv", "A", "1"]
    finally:
        box.stop()
