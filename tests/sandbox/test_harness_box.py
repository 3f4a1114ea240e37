"""An agent harness in its job's box: its model calls reach the job's endpoint, a Unix socket
the host serves in the box's endpoint directory, through the forwarder on the box's loopback
(`sandbox.llmforward`), and nothing else; `run_harness` bounds its output, returns its status
and ends when the box is halted.

Real bubblewrap boxes held by real keepers, with a stub endpoint the test serves on the
socket. mini-swe-agent runs from `.harness-venv` (`make harness-env`) when it is there.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandbox.base import ENDPOINT_DIR_INSIDE, Bind, SandboxError, SandboxSpec
from sandbox.bwrap import BubblewrapBackend
from sandbox.endpointdir import EndpointPaths, endpoint_paths, open_socket
from sandbox.harnesses import (
    FORWARDER,
    MINI_SWE_AGENT,
    harness_env_bind,
    harness_env_ready,
    harness_python,
    harness_venv,
)
from sandbox.keeper import KeptSandbox, halt, launch, release, run_harness
from sandbox.procs import labelled_pids
from sandbox.statedir import read_info
from tests.support.sandbox import Listener

KEY = "job-key-" + "k" * 24


@dataclass
class Seen:
    """One request the stub endpoint answered."""

    path: str
    headers: dict[str, str]
    """By their names in lower case."""
    body: dict[str, Any]


Reply = Callable[[Seen], dict[str, Any]]
Keep = Callable[..., KeptSandbox]
Serve = Callable[..., "StubEndpoint"]


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@dataclass
class StubEndpoint:
    """The job's endpoint as the test serves it on the box's socket: every POST is recorded
    and answered with `reply(seen)` as JSON."""

    paths: EndpointPaths
    reply: Reply
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                seen = Seen(self.path, headers, json.loads(self.rfile.read(length)))
                stub.seen.append(seen)
                out = json.dumps(stub.reply(seen)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = _UnixHTTPServer(str(self.paths.socket), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def echo_reply(seen: Seen) -> dict[str, Any]:
    return {"path": seen.path, "model": seen.body.get("model")}


@pytest.fixture
def keep(state_root: Path, job_processes: Callable[[str], list[int]]) -> Iterator[Keep]:
    """`keep(backend="bwrap", **spec_fields)` starts a kept sandbox with a model endpoint for
    a fresh job; each is released at the end and may leave no process behind."""
    made: list[KeptSandbox] = []

    def make(backend: str = "bwrap", **fields: Any) -> KeptSandbox:
        if backend == "bwrap":
            ok, why = BubblewrapBackend().available()
            if not ok:
                pytest.skip(f"bubblewrap cannot make boxes here: {why}")
        fields.setdefault("endpoint", True)
        spec = SandboxSpec(job_id=f"harness-{uuid.uuid4().hex[:10]}", **fields)
        kept = launch(spec, backend, state_root)
        made.append(kept)
        return kept

    yield make
    for kept in made:
        release(kept)
    leaks = {kept.job_id: job_processes(kept.job_id) for kept in made}
    assert not any(leaks.values()), f"processes left behind: {leaks}"


@pytest.fixture
def serve() -> Iterator[Serve]:
    """`serve(kept, reply=echo_reply)` serves a stub endpoint on the kept box's socket."""
    stubs: list[StubEndpoint] = []

    def start(kept: KeptSandbox, reply: Reply = echo_reply) -> StubEndpoint:
        paths = endpoint_paths(kept.state_dir)
        stub = StubEndpoint(paths, reply)
        stubs.append(stub)
        open_socket(paths, kept.as_dict())
        return stub

    yield start
    for stub in stubs:
        stub.close()


def python_in_box(code: str) -> list[str]:
    return ["python3", "-I", "-c", code]


def last_json(text: str) -> Any:
    return json.loads(text.strip().splitlines()[-1])


CALL_BOTH_APIS = """
import json, os, urllib.request
def post(url, headers):
    request = urllib.request.Request(url, data=b'{"model": "policy"}', headers=headers)
    return json.load(urllib.request.urlopen(request, timeout=30))
print(json.dumps({
    "openai": post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                   {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}),
    "anthropic": post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
                      {"x-api-key": os.environ["ANTHROPIC_API_KEY"]}),
    "env": {k: os.environ[k] for k in sorted(os.environ)},
}))
"""


def test_a_harness_reaches_its_endpoint_through_the_forwarder_with_its_variables(
    keep: Keep, serve: Serve
) -> None:
    kept = keep()
    stub = serve(kept)
    result = run_harness(
        kept, python_in_box(CALL_BOTH_APIS), api_key=KEY, env={"TASK": "t"}, timeout=60
    )
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    assert out["openai"] == {"path": "/v1/chat/completions", "model": "policy"}
    assert out["anthropic"] == {"path": "/v1/messages", "model": "policy"}
    assert [s.headers.get("authorization") for s in stub.seen] == [f"Bearer {KEY}", None]
    assert stub.seen[1].headers.get("x-api-key") == KEY
    env = out["env"]
    port = env["OPENAI_BASE_URL"].removeprefix("http://127.0.0.1:").removesuffix("/v1")
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}" and port.isdigit()
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == KEY
    # The box's clean environment, plus the harness's variables and nothing of the host's.
    assert env["TASK"] == "t" and env["HOME"] == "/tmp"
    assert not {"VIRTUAL_ENV", "PYTEST_CURRENT_TEST"} & set(env)


def test_the_endpoint_socket_admits_the_box_alone(keep: Keep, serve: Serve) -> None:
    kept = keep()
    stub = serve(kept)
    st = os.lstat(stub.paths.socket)
    info = read_info(Path(kept.state_dir))
    assert info is not None
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == (os.geteuid() if info.uid is None else info.uid)


SNOOP = """
import json, os, socket, sys
other_dir, host_port = sys.argv[1], int(sys.argv[2])
def connect(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect(address)
            return "connected"
        except OSError as exc:
            return type(exc).__name__
def write(path):
    try:
        open(path, "w").close()
        return "written"
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({
    "endpoint_dir": sorted(os.listdir("/rollserve/llm")),
    "rollserve": sorted(os.listdir("/rollserve")),
    "other_state_dir": os.path.exists(other_dir),
    "other_socket": connect(socket.AF_UNIX, other_dir + "/llm/endpoint.sock"),
    "host_port": connect(socket.AF_INET, ("127.0.0.1", host_port)),
    "outside": connect(socket.AF_INET, ("1.1.1.1", 53)),
    "interfaces": sorted(line.split(":")[0].strip()
                         for line in open("/proc/net/dev").readlines()[2:]),
    "write_endpoint_dir": write("/rollserve/llm/planted"),
    "replace_socket": write("/rollserve/llm/endpoint.sock"),
}))
"""


def test_a_box_sees_only_its_own_endpoint_and_no_network(
    keep: Keep, serve: Serve, host_listener: Listener
) -> None:
    mine, other = keep(), keep()
    serve(mine)
    serve(other)
    endpoint_paths(other.state_dir).directory.joinpath("other-marker").write_text("b")
    argv = [*python_in_box(SNOOP), other.state_dir, str(host_listener.port)]
    result = run_harness(mine, argv, api_key=KEY, timeout=60)
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    assert out["endpoint_dir"] == ["endpoint.sock"]
    assert out["rollserve"] == ["llm"]  # the tool socket is never in the box's filesystem
    assert out["other_state_dir"] is False
    assert out["other_socket"] == "FileNotFoundError"
    assert out["host_port"] == "ConnectionRefusedError"
    assert out["outside"] == "OSError"  # ENETUNREACH: no route out of the box
    assert out["interfaces"] == ["lo"]
    assert out["write_endpoint_dir"] != "written"
    assert out["replace_socket"] != "written"
    assert host_listener.accepted == 0


def test_run_harness_returns_the_exit_code_and_bounds_its_output(keep: Keep, serve: Serve) -> None:
    kept = keep()
    serve(kept)
    code = "import sys; print('o' * 200000); sys.stderr.write('e' * 200000); sys.exit(7)"
    result = run_harness(kept, python_in_box(code), api_key=KEY, timeout=60, max_output=1000)
    assert result.returncode == 7
    assert not result.timed_out
    assert result.stdout.startswith("o" * 1000)
    assert result.stderr.startswith("e" * 1000)
    assert "more bytes of output cut" in result.stdout
    assert "more bytes of output cut" in result.stderr
    assert len(result.stdout) < 1200 and len(result.stderr) < 1200


def test_halting_the_box_ends_a_running_harness(
    keep: Keep, serve: Serve, command_running: Callable[[str, str], None]
) -> None:
    kept = keep()
    serve(kept)
    results: list[Any] = []
    worker = threading.Thread(
        target=lambda: results.append(run_harness(kept, ["sleep", "1000"], timeout=600)),
        daemon=True,
    )
    worker.start()
    command_running(kept.job_id, "sleep")
    halt(kept)
    worker.join(60)  # a guard against a hang, not a bound on how fast it ends
    assert not worker.is_alive()
    assert results[0].returncode == -9
    assert not results[0].timed_out
    assert labelled_pids(kept.id) == []  # the forwarder and the harness are gone with the box


def test_a_sandbox_without_an_endpoint_runs_no_harness(keep: Keep) -> None:
    kept = keep(endpoint=False)
    with pytest.raises(SandboxError, match="without a model endpoint"):
        endpoint_paths(kept.state_dir)
    with pytest.raises(SandboxError, match="without a model endpoint"):
        run_harness(kept, ["true"], api_key=KEY, timeout=30)


def test_the_local_backend_reaches_the_endpoint_at_its_host_path(keep: Keep, serve: Serve) -> None:
    kept = keep("local")
    stub = serve(kept)
    result = run_harness(kept, python_in_box(CALL_BOTH_APIS), api_key=KEY, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [s.path for s in stub.seen] == ["/v1/chat/completions", "/v1/messages"]


ECHO_CLIENTS = """
import os, socket, sys, threading
port = int(os.environ["ECHO_URL"].rsplit(":", 1)[1])
payload = os.urandom(200_000)
ok = []
def client():
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)  # the echo answers only after our end of writing
        got = bytearray()
        while chunk := s.recv(65536):
            got += chunk
    ok.append(bytes(got) == payload)
threads = [threading.Thread(target=client) for _ in range(64)]
for t in threads: t.start()
for t in threads: t.join()
print(sum(ok))
sys.exit(5)
"""


def echo_server(path: Path) -> socket.socket:
    """A Unix socket server that reads each connection to its end, then sends it all back."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(128)

    def answer(conn: socket.socket) -> None:
        with conn:
            data = bytearray()
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def test_the_forwarder_relays_many_half_closed_connections_and_exits_with_its_command(
    state_root: Path,
) -> None:
    server = echo_server(state_root / "echo.sock")
    argv = [sys.executable, "-I", "-S", str(FORWARDER), "--socket", str(state_root / "echo.sock"),
            "--url", "ECHO_URL=http://127.0.0.1:{port}", "--",
            sys.executable, "-I", "-c", ECHO_CLIENTS]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        server.close()
    assert out.decode().strip() == "64"
    assert proc.returncode == 5


MINI_REPLY = {
    "role": "assistant",
    "content": "Submitting.",
    "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "bash", "arguments": json.dumps(
            {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; pwd; cat answer.txt"}
        )},
    }],
}  # fmt: skip


def chat_completion(seen: Seen) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0,
        "model": seen.body.get("model"),
        "choices": [{"index": 0, "message": MINI_REPLY, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }  # fmt: skip


def harness_bind() -> Bind:
    if not harness_env_ready():
        pytest.skip(f"no harness environment at {harness_venv()}: run `make harness-env`")
    return harness_env_bind()


def test_mini_swe_agent_runs_in_the_box_and_calls_its_endpoint(keep: Keep, serve: Serve) -> None:
    kept = keep(binds=[harness_bind()])
    stub = serve(kept, chat_completion)
    Path(kept.workspace, "answer.txt").write_text("42\n")
    os.chmod(Path(kept.workspace, "answer.txt"), 0o644)
    paths = endpoint_paths(kept.state_dir)
    paths.directory.joinpath("instruction.md").write_text("Print the answer.")
    argv = [str(harness_python()), str(MINI_SWE_AGENT),
            "--task-file", f"{ENDPOINT_DIR_INSIDE}/instruction.md", "--model", "openai/policy",
            "--step-limit", "3"]  # fmt: skip
    result = run_harness(kept, argv, api_key=KEY, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_json(result.stdout) == {
        "exit_status": "Submitted",
        "submission": "/workspace\n42\n",
        "model_calls": 1,
    }
    [call] = stub.seen
    assert call.path == "/v1/chat/completions"
    assert call.headers["authorization"] == f"Bearer {KEY}"
    assert call.body["model"] == "policy"
    assert [t["function"]["name"] for t in call.body["tools"]] == ["bash"]
    assert "Print the answer." in call.body["messages"][1]["content"]
