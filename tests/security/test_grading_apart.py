"""Grading talks to nothing the agent could have started, stopped or replaced.

Real bubblewrap boxes held by real keepers: the agent's shell is armed through its tool
server, the box is halted, and fresh commands run over its files (`workers.freshshell`).
The keeper's control socket is checked like the tool socket: a substitute never receives a
byte. A stage that meets a security error fails the job as `security`, never with a grade.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.schemas import JobStatus, StageError
from sandbox.base import SandboxSecurityError, SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.keeper import CONTROL_SOCKET, KeptSandbox, exec_fresh, launch, release
from sandbox.procs import labelled_pids
from sandbox.reaper import reap
from sandbox.statedir import read_info, remove_tree
from sandbox.toolclient import ToolClient, ToolSocketUntrusted
from workers import tasks
from workers.freshshell import FreshShell


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rs-grade-", dir="/tmp"))
    yield path
    remove_tree(path)


@pytest.fixture
def kept(root: Path) -> Iterator[KeptSandbox]:
    ok, why = BubblewrapBackend().available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    box = launch(SandboxSpec(job_id=f"grade-{uuid.uuid4().hex[:8]}"), "bwrap", root)
    yield box
    release(box)


def arm(kept: KeptSandbox) -> None:
    """What a hostile agent leaves in its session and its box."""
    with ToolClient(kept.socket_path, timeout=30) as tools:
        out = tools.call(
            "bash",
            command=(
                "test() { return 0; }; export -f test; alias ls=false; "
                "export BASH_ENV=/workspace/.evil ENV=/workspace/.evil SECRET=agent; "
                "echo 'test() { return 0; }' > /workspace/.evil; cp /workspace/.evil "
                "/workspace/.bashrc; cd /tmp; touch /tmp/agent-tmp; "
                "setsid nohup sleep 1000 >/dev/null 2>&1 & echo armed"
            ),
            timeout=10,
        )
    assert "armed" in str(out["output"])


def test_a_fresh_shell_inherits_nothing_of_the_agents_session(kept: KeptSandbox) -> None:
    arm(kept)
    assert len(labelled_pids(kept.id)) > 1  # the tool server, its shell, the sleeper
    shell = FreshShell(kept.as_dict())
    shell.halt()
    # Only the keeper is left of the box: every process in it is gone.
    assert labelled_pids(kept.id) == []
    result = shell.call(
        "bash",
        command=(
            'echo "cwd=$(pwd) test=$(type -t test) secret=${SECRET-} env=${BASH_ENV-}${ENV-}"; '
            "ls /tmp; test -f /workspace/.evil && echo files-stay"
        ),
        timeout=30,
    )
    assert result["exit_code"] == 0, result
    assert "cwd=/workspace test=builtin secret= env=" in result["output"]
    assert "files-stay" in result["output"]
    failing = shell.call("bash", command="test -f /workspace/absent", timeout=30)
    assert failing["exit_code"] == 1
    assert labelled_pids(kept.id) == []  # nothing of the checks outlives them either


def test_a_halted_box_waits_for_grading_until_its_job_is_over(
    kept: KeptSandbox, root: Path
) -> None:
    FreshShell(kept.as_dict()).halt()
    info = read_info(Path(kept.state_dir))
    assert info is not None and info.halted
    assert reap(root, lambda job_id: True) == []  # its main process is gone on purpose
    assert Path(kept.workspace).is_dir()
    assert reap(root, lambda job_id: False) == [kept.id]


class Substitute:
    """A socket served by this test process, counting the bytes it receives."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(4)
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b'{"returncode": 0, "stdout": "", "stderr": "", '
                                 b'"timed_out": false, "killed_by": null}\n')  # fmt: skip
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_a_substituted_control_socket_is_refused_before_a_byte(kept: KeptSandbox) -> None:
    path = Path(kept.state_dir) / CONTROL_SOCKET
    path.unlink()
    fake = Substitute(path)
    try:
        with pytest.raises(SandboxSecurityError, match="not the keeper"):
            exec_fresh(kept.as_dict(), ["true"], timeout=10)
        assert fake.received == b""
    finally:
        fake.close()


def test_a_linked_control_socket_is_refused(kept: KeptSandbox, root: Path) -> None:
    elsewhere = root / "elsewhere.sock"
    fake = Substitute(elsewhere)
    path = Path(kept.state_dir) / CONTROL_SOCKET
    path.unlink()
    path.symlink_to(elsewhere)
    try:
        with pytest.raises(SandboxSecurityError):
            exec_fresh(kept.as_dict(), ["true"], timeout=10)
        assert fake.received == b""
    finally:
        fake.close()


@pytest.mark.parametrize(
    "error",
    [ToolSocketUntrusted("tools.sock is a symlink"), SandboxSecurityError("not the keeper")],
)
def test_a_security_error_fails_the_job_as_security(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    ended: list[tuple[str, JobStatus, StageError | None]] = []
    runtime = SimpleNamespace(
        end_job=lambda job_id, status, err: ended.append((job_id, status, err)) or True
    )
    monkeypatch.setattr(tasks, "get_runtime", lambda: runtime)
    task: Any = SimpleNamespace(request=SimpleNamespace(chain=["next"]))

    def stage(rt: object, job_id: str) -> bool:
        raise error

    tasks.execute_stage(task, "eval", "job-1", stage)
    assert ended == [
        ("job-1", JobStatus.failed, StageError(stage="eval", type="security", message=str(error)))
    ]
    assert task.request.chain is None  # nothing runs after it: no grade
