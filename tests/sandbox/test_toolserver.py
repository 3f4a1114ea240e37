"""The tool server as a process: protocol, connections, shutdown, and life inside bwrap."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sandbox.toolclient import (
    AsyncToolClient,
    ToolCallTimeout,
    ToolClient,
    ToolError,
    ToolServerUnavailable,
)
from sandbox.toolserver import protocol
from sandbox.toolserver.processes import descendants

if TYPE_CHECKING:
    from tests.support.toolserver import StartToolServer, ToolServerProcess


def raw_connection(server: ToolServerProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(server.socket_path))
    return sock


def read_message(sock: socket.socket) -> dict[str, Any]:
    frames = protocol.FrameBuffer()
    while (message := frames.next_message()) is None:
        chunk = sock.recv(65536)
        assert chunk, "server closed the connection"
        frames.feed(chunk)
    return message


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


# protocol -------------------------------------------------------------------------------


def test_ping_answers_with_the_protocol_version(toolserver: ToolServerProcess) -> None:
    result = toolserver.client().ping()
    assert result == {
        "pong": True,
        "protocol": protocol.PROTOCOL_VERSION,
        "pid": toolserver.pid,
        "finished": False,
    }


def test_malformed_json_gets_an_error_and_the_connection_survives(
    toolserver: ToolServerProcess,
) -> None:
    with raw_connection(toolserver) as sock:
        sock.sendall(struct.pack(">I", 9) + b"{not json")
        error = read_message(sock)
        assert error["ok"] is False and error["id"] is None
        assert error["error"]["type"] == protocol.BAD_REQUEST
        sock.sendall(protocol.encode_frame(protocol.make_request(7, "ping", {})))
        assert read_message(sock)["id"] == 7


def test_request_of_the_wrong_shape_is_refused(toolserver: ToolServerProcess) -> None:
    with raw_connection(toolserver) as sock:
        sock.sendall(protocol.encode_frame({"id": 3, "args": {}}))
        answer = read_message(sock)
    assert answer["id"] == 3
    assert answer["error"] == {
        "type": protocol.BAD_REQUEST,
        "message": "request field `tool` must be a string",
    }


def test_oversized_frame_gets_an_error_and_the_connection_closes(
    toolserver: ToolServerProcess,
) -> None:
    with raw_connection(toolserver) as sock:
        sock.sendall(struct.pack(">I", protocol.DEFAULT_MAX_FRAME + 1))
        error = read_message(sock)
        assert error["error"]["type"] == protocol.FRAME_TOO_LARGE
        assert "exceeds the limit" in error["error"]["message"]
        assert sock.recv(1) == b""
    assert toolserver.client().ping()["pong"] is True


def test_unknown_tool_is_a_tool_error(toolserver: ToolServerProcess) -> None:
    with pytest.raises(ToolError) as info:
        toolserver.client().call("teleport")
    assert info.value.type == protocol.UNKNOWN_TOOL


def test_missing_argument_is_named(toolserver: ToolServerProcess) -> None:
    with pytest.raises(ToolError) as info:
        toolserver.client().call("bash", timeout=5)
    assert (info.value.type, info.value.message) == (
        protocol.INVALID_ARGUMENTS,
        "argument `command` must be a string",
    )


def test_editor_refusal_is_an_editor_error(toolserver: ToolServerProcess) -> None:
    with pytest.raises(ToolError) as info:
        toolserver.client().call("editor", command="view", path="relative.txt")
    assert info.value.type == protocol.EDITOR_ERROR
    assert "is not an absolute path" in info.value.message


def test_editor_edits_files_the_shell_sees(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    path = toolserver.workdir / "hello.py"
    client.call("editor", command="create", path=str(path), file_text="print('hi')\n")
    client.call("editor", command="str_replace", path=str(path), old_str="hi", new_str="bye")
    assert client.call("bash", command="python3 hello.py")["output"] == "bye\n"


def test_finish_records_the_result(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    assert client.call("finish", result="42") == {"finished": True}
    assert client.ping()["finished"] is True


# connections and state ------------------------------------------------------------------


def test_requests_on_one_connection_reuse_the_same_shell(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    first = client.call("bash", command="echo $$")["output"]
    second = client.call("bash", command="echo $$")["output"]
    assert first == second


def test_sequential_connections_share_the_session(toolserver: ToolServerProcess) -> None:
    with ToolClient(toolserver.socket_path) as first:
        first.call("bash", command="cd /tmp && export MARK=1")
    for _ in range(3):
        with ToolClient(toolserver.socket_path) as later:
            assert later.call("bash", command="pwd; echo $MARK")["output"] == "/tmp\n1\n"


def test_ping_answers_while_a_command_runs(toolserver: ToolServerProcess) -> None:
    busy = toolserver.client()
    with contextlib.closing(busy):
        busy.connect()
        request = protocol.make_request(1, "bash", {"command": "sleep 2", "timeout": 10})
        assert busy._sock is not None
        busy._sock.sendall(protocol.encode_frame(request))
        assert toolserver.client().ping()["pong"] is True
        # ... answered while the command still runs: its reply has not come yet.
        assert select.select([busy._sock], [], [], 0)[0] == []


def test_reset_starts_a_fresh_shell(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    client.call("bash", command="cd /tmp && export MARK=1")
    assert client.call("reset") == {"bash": True, "ipython": False}
    output = client.call("bash", command='pwd; echo "[$MARK]"')["output"]
    assert output == f"{toolserver.workdir}\n[]\n"


async def test_async_client_calls_tools(toolserver: ToolServerProcess) -> None:
    async with AsyncToolClient(toolserver.socket_path, timeout=10) as client:
        assert (await client.ping())["pong"] is True
        result = await client.call("bash", command="echo async")
        assert result["output"] == "async\n"
        with pytest.raises(ToolError):
            await client.call("bash")


def test_tcp_listener_serves_the_same_tools(start_toolserver: StartToolServer) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start_toolserver(args=["--tcp", f"127.0.0.1:{port}"])
    with ToolClient.tcp("127.0.0.1", port, timeout=10) as client:
        assert client.call("bash", command="echo tcp")["output"] == "tcp\n"


def test_client_without_a_server_raises_unavailable(tmp_path: Path) -> None:
    with pytest.raises(ToolServerUnavailable), ToolClient(tmp_path / "none.sock") as client:
        client.ping()


def test_client_reconnects_after_a_call_times_out(toolserver: ToolServerProcess) -> None:
    client = toolserver.client(timeout=0.2)
    with pytest.raises(ToolCallTimeout):
        client.call("bash", command="sleep 1")  # no per-call timeout: the client's applies
    client.timeout = 10
    assert client.call("bash", command="echo back")["output"] == "back\n"


# shutdown -------------------------------------------------------------------------------


def test_sigterm_exits_and_leaves_no_child_behind(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    client.call("bash", command="sleep 100 & (setsid sleep 101 &)")
    client.call("ipython", code="import subprocess; subprocess.Popen(['sleep', '102'])")
    children = toolserver.descendants()
    commands = {Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children}
    assert any(b"ipykernel" in command for command in commands)
    assert sum(command.startswith(b"sleep\x0010") for command in commands) == 3
    toolserver.proc.send_signal(signal.SIGTERM)
    assert toolserver.proc.wait(timeout=10) == 0
    assert wait_until_gone(children) == []
    assert not toolserver.socket_path.exists()


def test_server_exits_when_its_parent_dies(tmp_path: Path) -> None:
    from tests.support.toolserver import short_tempdir

    sockdir = short_tempdir()
    socket_path = sockdir / "tools.sock"
    parent_code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-m', 'sandbox.toolserver', "
        f"'--socket', {str(socket_path)!r}, '--workdir', {str(tmp_path)!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, cwd=Path.cwd()
    )
    assert parent.stdout is not None
    server_pid = int(parent.stdout.readline())
    tree: list[int] = [server_pid]
    try:
        with ToolClient(socket_path, timeout=10) as client:
            client.wait_until_ready(timeout=15)
            client.call("bash", command="true")
        tree += descendants(server_pid)
        parent.kill()
        parent.wait(timeout=5)
        assert wait_until_gone(tree) == []
    finally:
        parent.kill()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(sockdir, ignore_errors=True)


# inside bubblewrap ----------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_server_inside_bubblewrap_answers_from_outside(
    start_toolserver: StartToolServer,
) -> None:
    # The service's environment is bound back over the box's fresh /tmp, where a checkout
    # and its venv may live.
    service = [str(Path(p).resolve()) for p in (sys.prefix, Path(__file__).parents[2])]

    def bwrap(sockdir: Path, work: Path) -> list[str]:
        return [
            *("bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
            *("--tmpfs", "/tmp", "--bind", str(sockdir), str(sockdir)),
            *(arg for path in service for arg in ("--ro-bind", path, path)),
            *("--unshare-all", "--die-with-parent", "--"),
            *(sys.executable, "-m", "sandbox.toolserver", "--socket", f"{sockdir}/tools.sock"),
        ]

    server = start_toolserver(argv=bwrap)
    client = server.client()
    shell = client.call("bash", command="echo $$; touch /tmp/inside-bwrap; touch /etc/x")
    pid, error = shell["output"].splitlines()
    assert int(pid) < 10  # a fresh pid namespace
    assert "Read-only file system" in error
    assert not Path("/tmp/inside-bwrap").exists()  # the sandbox has a /tmp of its own
    cell = client.call("ipython", code="import os; os.getpid() < 10, 6 * 7", timeout=60)
    assert (cell["status"], cell["output"]) == ("ok", "(True, 42)\n")


def test_frame_helpers_round_trip() -> None:
    message = {"id": 1, "tool": "bash", "args": {"command": "echo ü"}}
    frame = protocol.encode_frame(message)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    buffer = protocol.FrameBuffer()
    buffer.feed(frame[:3])
    assert buffer.next_message() is None
    buffer.feed(frame[3:])
    assert buffer.next_message() == message
    assert json.loads(frame[4:]) == message
