"""The Apptainer backend.

Apptainer cannot be installed on these machines, so most tests put a stand-in `singularity`
command on PATH: it records every call spython (and this backend) makes, keeps instances as
files with a sleeping process for each, builds "images" as small files, and runs an `exec`'s
command on the host. What is checked is the command lines, the image cache and the
lifecycle. The end-to-end test at the bottom runs only where a real `apptainer` or
`singularity` is on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.apptainer import ApptainerBackend, ApptainerSandbox, image_cache_name
from sandbox.backends import get_backend
from sandbox.base import Bind, SandboxError, SandboxSpec
from sandbox.procs import LABEL_ID, LABEL_JOB
from sandbox.reaper import reap

JobProcesses = Callable[[str], list[int]]

STAND_IN = '''\
#!{python}
"""A stand-in for the singularity command (see the test module's docstring)."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

state = Path(os.environ["STAND_IN_STATE"])
args = sys.argv[1:]
passed = {{k: v for k, v in os.environ.items() if k.startswith(("APPTAINERENV_", "ROLLSERVE_"))}}
with open(state / "calls.jsonl", "a") as calls:
    calls.write(json.dumps({{"argv": args, "env": passed}}) + "\\n")
while args and args[0] in ("--quiet", "--debug"):
    args = args[1:]
VALUED = {{"--bind", "-B", "--network", "--pwd", "--env", "-t"}}

def split(words):
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in VALUED else 1
    return words[:i], words[i:]

def instance(name):
    path = state / "instances" / (name + ".json")
    return json.loads(path.read_text()) if path.exists() else None

if args == ["--version"]:
    print("apptainer version 1.3.4")
elif args[:2] == ["instance", "start"]:
    options, (image, name) = split(args[2:])
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    record = {{"instance": name, "pid": sleeper.pid, "img": image}}
    (state / "instances" / (name + ".json")).write_text(json.dumps(record))
    print("INFO:    instance started successfully", file=sys.stderr)
elif args[:2] == ["instance", "list"]:
    options, rest = split(args[2:])
    found = [instance(rest[0])] if rest else [
        json.loads(p.read_text()) for p in (state / "instances").glob("*.json")]
    print(json.dumps({{"instances": [i for i in found if i]}}))
elif args[:2] == ["instance", "stop"]:
    options, (name,) = split(args[2:])
    record = instance(name)
    if record is None:
        print("FATAL:   no instance found with name " + name, file=sys.stderr)
        sys.exit(255)
    try:
        os.kill(record["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    (state / "instances" / (name + ".json")).unlink()
elif args[:1] == ["build"]:
    options, (image, recipe) = split(args[1:])
    time.sleep(0.3)  # long enough for a second builder to arrive
    Path(image).write_text("an image of " + recipe + "\\n")
elif args[:1] == ["exec"]:
    options, (target, *command) = split(args[1:])
    if os.environ.get("STAND_IN_EXEC_HANGS"):
        time.sleep(600)
    if target.startswith("instance://") and instance(target[len("instance://"):]) is None:
        print("FATAL:   no instance found", file=sys.stderr)
        sys.exit(255)
    env = {{"PATH": "/usr/bin:/bin"}} if "--cleanenv" in options else dict(os.environ)
    for key, value in os.environ.items():
        if key.startswith("APPTAINERENV_"):
            env[key[len("APPTAINERENV_"):]] = value
    os.execvpe(command[0], command, env)
else:
    print("FATAL:   the stand-in does not know " + " ".join(args), file=sys.stderr)
    sys.exit(2)
'''


class StandIn:
    """The stand-in's state: the calls it saw and the instances it keeps."""

    def __init__(self, state: Path) -> None:
        self.state = state

    def calls(self, *prefix: str) -> list[list[str]]:
        lines = (self.state / "calls.jsonl").read_text().splitlines()
        argvs = [[a for a in json.loads(line)["argv"] if a != "--quiet"] for line in lines]
        return [a for a in argvs if a[: len(prefix)] == list(prefix)]

    def envs(self, *prefix: str) -> list[dict[str, str]]:
        lines = (self.state / "calls.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        return [
            r["env"]
            for r in records
            if [a for a in r["argv"] if a != "--quiet"][: len(prefix)] == list(prefix)
        ]

    def instances(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in (self.state / "instances").glob("*.json")]


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    bin_dir, state = tmp_path / "bin", tmp_path / "stand-in"
    bin_dir.mkdir()
    (state / "instances").mkdir(parents=True)
    (state / "calls.jsonl").write_text("")
    command = bin_dir / "singularity"
    command.write_text(STAND_IN.format(python=sys.executable))
    command.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_STATE", str(state))
    helper = StandIn(state)
    yield helper
    for record in helper.instances():  # whatever a failed test left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(record["pid"], signal.SIGKILL)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "box.sif"
    path.write_text("an image\n")
    return path


@pytest.fixture
def apptainer_sandbox(
    stand_in: StandIn, state_root: Path, image: Path, job_processes: JobProcesses
) -> Iterator[Callable[..., ApptainerSandbox]]:
    """`make(fakeroot=False, **spec_fields)`: a sandbox (of `image` unless `root` is given)
    for a fresh job; all are stopped at the end and must leave no process behind."""
    made: list[ApptainerSandbox] = []

    def make(fakeroot: bool = False, **fields: Any) -> ApptainerSandbox:
        fields.setdefault("root", str(image))
        fields.setdefault("job_id", f"test-{uuid.uuid4().hex[:12]}")
        box = ApptainerBackend(fakeroot=fakeroot).create(SandboxSpec(**fields), state_root)
        made.append(box)
        return box

    yield make
    for box in made:
        box.stop()
    assert [job_processes(box.job_id) for box in made] == [[] for _ in made]


def option_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_not_available_without_apptainer_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, why = ApptainerBackend().available()
    assert not ok and why == "neither apptainer nor singularity is on PATH"
    with pytest.raises(SandboxError, match="neither apptainer nor singularity"):
        ApptainerBackend().create(SandboxSpec(job_id="j", root="x.sif"), tmp_path)


def test_apptainer_without_its_singularity_link_is_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "apptainer").write_text("#!/bin/sh\n")
    (tmp_path / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, why = ApptainerBackend().available()
    assert not ok and "`singularity` link" in why


def test_available_with_the_command_on_path(stand_in: StandIn) -> None:
    assert ApptainerBackend().available() == (True, "")


def test_auto_prefers_apptainer_where_it_works(stand_in: StandIn) -> None:
    assert get_backend("auto").name == "apptainer"


def test_instance_start_is_contained_offline_and_binds_socket_and_workspace(
    apptainer_sandbox: Callable[..., ApptainerSandbox], image: Path, stand_in: StandIn
) -> None:
    box = apptainer_sandbox(binds=[Bind(Path("/etc"), "/hostetc")], env={"A": "1"})
    box.start(tool_server=False)
    assert box.alive()
    [argv] = stand_in.calls("instance", "start")
    for flag in ("--contain", "--writable-tmpfs", "--no-home", "--cleanenv", "--net"):
        assert flag in argv
    assert option_values(argv, "--network") == ["none"]
    assert "--fakeroot" not in argv
    binds = option_values(argv, "--bind")
    assert f"{box.workspace}:/workspace:rw" in binds
    assert f"{box.state_dir / 'sock'}:/rollserve/sock:rw" in binds
    assert "/etc:/hostetc:ro" in binds
    prefix = Path(sys.prefix).resolve()
    assert any(b.endswith(":ro") and Path(b.split(":")[0]) in {prefix, *prefix.parents}
               for b in binds)  # fmt: skip
    assert argv[-2:] == [str(image), box.instance]
    # The instance's processes are labelled, and the spec's env is passed under --cleanenv.
    [env] = stand_in.envs("instance", "start")
    assert env[LABEL_ID] == box.id and env[LABEL_JOB] == box.job_id
    assert env["APPTAINERENV_A"] == "1"
    assert env[f"APPTAINERENV_{LABEL_JOB}"] == box.job_id


def test_network_on_is_refused_and_fakeroot_is_a_backend_option(
    apptainer_sandbox: Callable[..., ApptainerSandbox], stand_in: StandIn
) -> None:
    with pytest.raises(SandboxError, match="only bwrap gives a box a network"):
        apptainer_sandbox(network=True)
    apptainer_sandbox(fakeroot=True).start(tool_server=False)
    [argv] = stand_in.calls("instance", "start")
    assert option_values(argv, "--network") == ["none"]
    assert "--fakeroot" in argv


def test_exec_runs_inside_the_instance_with_a_clean_environment(
    apptainer_sandbox: Callable[..., ApptainerSandbox], stand_in: StandIn
) -> None:
    box = apptainer_sandbox(env={"FROM_SPEC": "a, b and 'c'"})
    box.start(tool_server=False)
    result = box.exec(["sh", "-c", 'echo "$FROM_SPEC"; echo "$CALL"'], env={"CALL": "x"})
    assert result.stdout == "a, b and 'c'\nx\n", result.stderr
    [argv] = stand_in.calls("exec")
    assert argv[:5] == ["exec", "--cleanenv", "--pwd", "/workspace", f"instance://{box.instance}"]
    assert argv[5:8] == [sys.executable, "-S", "-I"]  # the launcher, then the command
    assert argv[-3:] == ["sh", "-c", 'echo "$FROM_SPEC"; echo "$CALL"']


def test_exec_before_start_runs_a_one_off_container_with_the_same_options(
    apptainer_sandbox: Callable[..., ApptainerSandbox], image: Path, stand_in: StandIn
) -> None:
    box = apptainer_sandbox()
    assert box.exec(["echo", "one-off"]).stdout == "one-off\n"
    [argv] = stand_in.calls("exec")
    options = argv[argv.index("/workspace") + 1 : argv.index(str(image))]
    assert options == box.container_options()


def test_an_exec_that_never_ends_is_stopped_by_its_timeout(
    apptainer_sandbox: Callable[..., ApptainerSandbox],
) -> None:
    box = apptainer_sandbox()
    box.start(tool_server=False)
    result = box.exec(["sleep", "1000"], timeout=0.5)
    assert result.timed_out and result.killed_by == "SIGKILL"


def test_stop_stops_the_instance_and_leaves_nothing(
    apptainer_sandbox: Callable[..., ApptainerSandbox],
    stand_in: StandIn,
    job_processes: JobProcesses,
) -> None:
    box = apptainer_sandbox()
    box.start(tool_server=False)
    assert job_processes(box.job_id)
    box.stop()
    box.stop()
    assert [argv[-1] for argv in stand_in.calls("instance", "stop")] == [box.instance]
    assert stand_in.instances() == []
    assert job_processes(box.job_id) == []
    assert not box.state_dir.exists() and not box.alive()


def test_the_reaper_stops_the_instance_of_an_ended_job(
    apptainer_sandbox: Callable[..., ApptainerSandbox],
    stand_in: StandIn,
    state_root: Path,
    job_processes: JobProcesses,
) -> None:
    box = apptainer_sandbox()
    box.start(tool_server=False)
    assert reap(state_root, lambda job_id: False) == [box.id]
    assert stand_in.instances() == []
    assert job_processes(box.job_id) == []


def test_the_tool_server_runs_through_instance_exec(
    apptainer_sandbox: Callable[..., ApptainerSandbox],
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stand-in's exec hangs here: a tool server that never listens, so start gives up.
    monkeypatch.setenv("STAND_IN_EXEC_HANGS", "1")
    box = apptainer_sandbox()
    with pytest.raises(SandboxError, match="did not listen"):
        box.start(tool_server=True, timeout=1)
    [argv] = stand_in.calls("exec")
    assert f"instance://{box.instance}" in argv
    assert argv[-7:] == [
        sys.executable, "-m", "sandbox.toolserver",
        "--socket", "/rollserve/sock/tools.sock", "--workdir", "/workspace",
    ]  # fmt: skip
    assert stand_in.instances() == []  # the failed start stopped its instance


def test_a_docker_reference_is_built_once_per_node(
    apptainer_sandbox: Callable[..., ApptainerSandbox], stand_in: StandIn, state_root: Path
) -> None:
    reference = "docker://python:3.11-slim"
    boxes: list[ApptainerSandbox] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            boxes.append(apptainer_sandbox(root=reference))
        except BaseException as exc:
            errors.append(exc)

    racers = [threading.Thread(target=create) for _ in range(3)]
    for thread in racers:
        thread.start()
    for thread in racers:
        thread.join(30)
    assert not errors
    builds = stand_in.calls("build")
    assert len(builds) == 1
    cached = state_root / ".images" / image_cache_name(reference)
    assert builds[0][-1] == reference
    assert {box.image for box in boxes} == {cached}
    assert cached.read_text() == f"an image of {reference}\n"
    assert [p.name for p in cached.parent.glob("*.partial")] == []
    apptainer_sandbox(root=reference)
    assert len(stand_in.calls("build")) == 1


def test_image_cache_names_are_readable_and_distinct() -> None:
    first = image_cache_name("docker://python:3.11-slim")
    assert first.startswith("python_3.11-slim-") and first.endswith(".sif")
    assert first != image_cache_name("docker://python:3.12-slim")


def test_a_missing_image_or_none_at_all_is_an_error(
    stand_in: StandIn, state_root: Path, tmp_path: Path
) -> None:
    backend = ApptainerBackend()
    with pytest.raises(SandboxError, match="does not exist"):
        backend.create(SandboxSpec(job_id="j", root=str(tmp_path / "gone.sif")), state_root)
    with pytest.raises(SandboxError, match="needs an image"):
        backend.create(SandboxSpec(job_id="j"), state_root)


# End to end, where Apptainer (or Singularity) is installed.

REAL = shutil.which("apptainer") or shutil.which("singularity")
E2E_IMAGE = os.environ.get("ROLLSERVE_TEST_APPTAINER_IMAGE", "docker://debian:12-slim")


@pytest.mark.skipif(
    REAL is None or shutil.which("singularity") is None,
    reason="Apptainer is not installed here (it is in neither Debian 12 nor PyPI); "
    "this test runs where `apptainer` (with its `singularity` link) is on PATH",
)
def test_end_to_end_with_real_apptainer(
    state_root: Path, job_processes: JobProcesses, tmp_path: Path
) -> None:
    backend = ApptainerBackend(cache_dir=tmp_path / "images")
    box = backend.create(SandboxSpec(job_id="apptainer-e2e", root=E2E_IMAGE), state_root)
    try:
        box.start(tool_server=False, timeout=120)
        assert box.alive()
        (box.workspace / "in.txt").write_text("from the host\n")
        script = textwrap.dedent(
            """\
            cat in.txt
            echo from the box > out.txt
            touch /etc/pwned 2>/dev/null; test -e /etc/pwned && echo in-the-box-only
            """
        )
        result = box.exec(["sh", "-c", script], timeout=60)
        assert result.stdout.splitlines()[0] == "from the host", result
        assert (box.workspace / "out.txt").read_text() == "from the box\n"
        assert not Path("/etc/pwned").exists()
    finally:
        box.stop()
    assert job_processes(box.job_id) == []
