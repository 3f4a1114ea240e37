"""The tool socket a worker connects through cannot be subverted by the box.

Real bubblewrap boxes; a hostile script runs in the box through the agent's own shell and
tries to (a) replace `tools.sock` by a symlink to a socket the host owns, (b) bind a server
of its own at the socket path, (c) link the path to another box's socket. The box cannot even
see the socket directory, so each attempt fails there; the same substitution is then made
from the host (what a box could do if the directory were writable to it), and the client must
refuse with ToolSocketUntrusted before the substitute receives a single byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandbox.base import Sandbox, SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.keeper import launch, release
from sandbox.statedir import SOCKET_RECORD, SocketIdentity, read_socket_identity
from sandbox.toolclient import AsyncToolClient, ToolClient, ToolSocketUntrusted
from sandbox.toolserver import protocol

SOCKET_INSIDE = "/rollserve/sock/tools.sock"


class FakeServer:
    """A host-owned Unix socket that answers any request with a passing grade, and records
    every connection and every byte it receives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(8)
        self.connections = 0
        self.received = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2.0)
                try:
                    data = conn.recv(65536)
                except OSError:
                    continue
                self.received += data
                answer = {"output": "PASSED", "exit_code": 0, "timed_out": False}
                fake = protocol.ok_response(1, answer)
                with contextlib.suppress(OSError):
                    conn.sendall(protocol.encode_frame(fake))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self._thread.join(5)


@pytest.fixture
def make_box(state_root: Path) -> Iterator[Callable[[], Sandbox]]:
    """`make_box()` starts a bwrap box with its tool server; all are stopped afterwards."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    backend = BubblewrapBackend()
    ok, why = backend.available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    made: list[Sandbox] = []

    def make() -> Sandbox:
        box = backend.create(SandboxSpec(job_id=f"sec-{os.urandom(6).hex()}"), state_root)
        made.append(box)
        box.start(tool_server=True)
        return box

    yield make
    for box in made:
        box.stop()


@pytest.fixture
def fake_server(state_root: Path) -> Iterator[FakeServer]:
    server = FakeServer(state_root / "fake.sock")
    yield server
    server.close()


def identity(box: Sandbox) -> SocketIdentity:
    recorded = read_socket_identity(box.state_dir)
    assert recorded is not None
    return recorded


def agent_runs(box: Sandbox, script: str) -> str:
    """Run `script` in the agent's own shell in the box (through the tool server)."""
    with ToolClient(box.socket_path, timeout=30) as tools:
        return str(tools.call("bash", command=script, timeout=20)["output"])


def assert_socket_untouched(box: Sandbox, before: SocketIdentity) -> None:
    st = os.lstat(box.socket_path)
    assert (st.st_dev, st.st_ino) == (before.dev, before.ino)
    assert agent_runs(box, "echo still-here").strip() == "still-here"


def assert_refused(box: Sandbox, fake: FakeServer, expect: SocketIdentity | None = None) -> str:
    """Both clients refuse to use `box`'s socket path, and `fake` receives no request."""
    with (
        pytest.raises(ToolSocketUntrusted) as refused,
        ToolClient(box.socket_path, timeout=5, expect=expect) as tools,
    ):
        tools.call("bash", command="test -f /workspace/done", timeout=5)

    async def async_call() -> None:
        async with AsyncToolClient(box.socket_path, timeout=5, expect=expect) as tools:
            await tools.call("bash", command="test -f /workspace/done", timeout=5)

    with pytest.raises(ToolSocketUntrusted):
        asyncio.run(async_call())
    assert fake.received == b"", "the substitute received a request"
    return str(refused.value)


def test_the_box_does_not_see_the_socket_directory(make_box: Callable[[], Sandbox]) -> None:
    box = make_box()
    before = identity(box)
    out = agent_runs(box, f"ls -la /rollserve/sock {box.state_dir / 'sock'} 2>&1; echo done")
    assert "tools.sock" not in out
    assert os.stat(box.state_dir / "sock").st_uid == os.geteuid()
    assert os.stat(box.state_dir / "sock").st_mode & 0o077 == 0
    assert_socket_untouched(box, before)


def test_a_symlink_to_a_host_socket_is_refused(
    make_box: Callable[[], Sandbox], fake_server: FakeServer
) -> None:
    box = make_box()
    before = identity(box)
    # (a) in the box: replace the socket by a symlink to the host's socket.
    out = agent_runs(
        box,
        f"rm -f {SOCKET_INSIDE}; ln -sf {fake_server.path} {SOCKET_INSIDE} 2>&1; "
        f"rm -f {box.socket_path}; ln -sf {fake_server.path} {box.socket_path} 2>&1; echo rc=$?",
    )
    assert "rc=0" not in out
    assert_socket_untouched(box, before)
    # The same, had the directory been writable to the box.
    os.unlink(box.socket_path)
    os.symlink(fake_server.path, box.socket_path)
    message = assert_refused(box, fake_server)
    assert "symlink" in message and str(fake_server.path) in message
    assert fake_server.connections == 0


def test_a_server_bound_at_the_socket_path_is_refused(
    make_box: Callable[[], Sandbox], state_root: Path
) -> None:
    box = make_box()
    before = identity(box)
    # (b) in the box: remove the socket and serve a fake grade at its path.
    bind = (
        "import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
        "print('bound')"
    )
    out = agent_runs(
        box,
        f"for p in {SOCKET_INSIDE} {box.socket_path}; do rm -f $p; "
        f'python3 -c "{bind}" $p 2>&1 | tail -1; done',
    )
    assert "bound" not in out
    assert_socket_untouched(box, before)
    # The same, had the directory been writable to the box: another socket at the path.
    os.unlink(box.socket_path)
    fake = FakeServer(box.socket_path)
    try:
        message = assert_refused(box, fake)
        assert "another socket" in message and f"inode {before.ino}" in message
        assert fake.connections == 0
        # Even with a record naming the substitute's inode, the process listening is not the
        # tool server.
        st = os.lstat(box.socket_path)
        forged = SocketIdentity(dev=st.st_dev, ino=st.st_ino, pid=before.pid, uid=before.uid)
        message = assert_refused(box, fake, expect=forged)
        assert f"pid {os.getpid()}" in message and f"pid {before.pid}" in message
    finally:
        fake.close()


def test_a_link_to_another_box_socket_is_refused(make_box: Callable[[], Sandbox]) -> None:
    victim, attacker = make_box(), make_box()
    before = identity(attacker)
    # (c) in the box: point its socket path at the victim's socket.
    out = agent_runs(
        attacker,
        f"rm -f {SOCKET_INSIDE}; ln -sf {victim.socket_path} {SOCKET_INSIDE} 2>&1; "
        f"ln -f {victim.socket_path} {attacker.socket_path} 2>&1; echo rc=$?",
    )
    assert "rc=0" not in out
    assert_socket_untouched(attacker, before)
    victim_before = agent_runs(victim, "echo $ROLLSERVE_SANDBOX_ID").strip()
    assert victim_before == victim.id
    # The same, had the directory been writable to the box: a symlink, then a hard link.
    witness = FakeServer(attacker.state_dir.parent / "unused.sock")
    try:
        os.unlink(attacker.socket_path)
        os.symlink(victim.socket_path, attacker.socket_path)
        assert "symlink" in assert_refused(attacker, witness)
        os.unlink(attacker.socket_path)
        os.link(victim.socket_path, attacker.socket_path)
        assert "another socket" in assert_refused(attacker, witness)
        # And the victim's own socket, with the attacker's record, is not the attacker's.
        with (
            pytest.raises(ToolSocketUntrusted, match="another socket"),
            ToolClient(victim.socket_path, expect=before) as tools,
        ):
            tools.ping()
    finally:
        witness.close()
    assert agent_runs(victim, "echo $ROLLSERVE_SANDBOX_ID").strip() == victim.id


def test_a_socket_without_a_record_is_refused(
    make_box: Callable[[], Sandbox], fake_server: FakeServer
) -> None:
    box = make_box()
    (box.state_dir / SOCKET_RECORD).unlink()
    assert "no record" in assert_refused(box, fake_server)


def test_a_normal_box_works_and_every_connection_is_checked(
    make_box: Callable[[], Sandbox],
) -> None:
    box = make_box()
    recorded = identity(box)
    assert recorded == getattr(box, "socket_identity", None)
    assert recorded.pid != os.getpid()
    box_uid = getattr(box, "info").uid  # noqa: B009 - the bwrap box's SandboxInfo
    assert recorded.uid == (box_uid if box_uid is not None else os.geteuid())
    with ToolClient(box.socket_path, timeout=30) as tools:
        assert tools.ping()["pid"] != recorded.pid  # its own pid namespace
        for i in range(50):
            assert tools.call("bash", command=f"echo {i}", timeout=10)["output"].strip() == str(i)
    for _ in range(20):  # a fresh, checked connection each time
        with ToolClient(box.socket_path, timeout=30, expect=recorded) as tools:
            assert tools.ping()["pong"] is True

    async def async_round_trip() -> str:
        async with AsyncToolClient(box.socket_path, timeout=30) as tools:
            result = await tools.call("bash", command="echo async", timeout=10)
            return str(result["output"])

    assert asyncio.run(async_round_trip()).strip() == "async"


def test_the_keeper_records_the_tool_server(state_root: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    ok, why = BubblewrapBackend().available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    kept = launch(SandboxSpec(job_id=f"sec-{os.urandom(6).hex()}"), "bwrap", state_root)
    try:
        assert kept.tool_socket is not None
        recorded = SocketIdentity.from_dict(kept.tool_socket)
        assert recorded == read_socket_identity(Path(kept.state_dir))
        with ToolClient(kept.socket_path, expect=kept.tool_socket) as tools:
            assert tools.call("bash", command="echo kept", timeout=10)["output"].strip() == "kept"
    finally:
        release(kept)
    assert not Path(kept.state_dir).exists()
