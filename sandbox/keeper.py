"""Keeps one sandbox alive independently of the worker process that asked for it.

INIT starts a job's sandbox, RUN and EVAL use it later, maybe from other pool processes of
the host; a box tied to the INIT process (bubblewrap's --die-with-parent) would die when that
process is recycled. So a small keeper process, in its own session, owns the box: it starts
it, reports where its tool server listens, and stops it on SIGTERM, when its lease runs out,
or when the box dies. Any process on the host stops it with `release`.

    python -m sandbox.keeper --backend bwrap --state-root DIR  < spec.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.backends import get_backend
from sandbox.base import (
    EXEC_OUTPUT_LIMIT,
    Bind,
    ExecResult,
    Limits,
    Sandbox,
    SandboxError,
    SandboxSecurityError,
    SandboxSpec,
)
from sandbox.harnesses import forwarder_argv, key_env
from sandbox.startup import peer_credentials
from sandbox.statedir import SocketIdentity


@dataclass(frozen=True)
class KeptSandbox:
    """A sandbox held by a keeper process, as a worker records it in the job."""

    id: str
    job_id: str
    backend: str
    keeper_pid: int
    state_dir: str
    socket_path: str
    workspace: str
    tool_socket: dict[str, int] | None = None
    """The tool server's socket and process as recorded when it started (`SocketIdentity`);
    clients check every connection against it."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


KEEPER_LABEL = "ROLLSERVE_KEEPER_OF_JOB"
"""Environment label of a keeper process: the job id, so a reused pid is never mistaken."""


class SandboxStartError(RuntimeError):
    """The keeper could not start the sandbox; the message says why."""


def spec_to_json(spec: SandboxSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), default=str)


def spec_from_json(text: str) -> SandboxSpec:
    data = json.loads(text)
    data["binds"] = [
        Bind(Path(b["host"]), b["inside"], b.get("read_only", True)) for b in data.get("binds", [])
    ]
    data["limits"] = Limits(**data.get("limits", {}))
    if data.get("workspace") is not None:
        data["workspace"] = Path(data["workspace"])
    return SandboxSpec(**data)


def launch(spec: SandboxSpec, backend: str, state_root: Path, timeout: float = 60.0) -> KeptSandbox:
    """Start a keeper for `spec` and wait until its sandbox's tool server is ready."""
    state_root.mkdir(parents=True, exist_ok=True)
    log = open(log_path(state_root, spec.job_id), "ab")  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.keeper", "--backend", backend,
             "--state-root", str(state_root.resolve())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            start_new_session=True,  # outlives the worker process that launched it
            env={**os.environ, KEEPER_LABEL: spec.job_id},
        )  # fmt: skip
    finally:
        log.close()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(spec_to_json(spec).encode())
    proc.stdin.close()
    line = _read_line(proc, timeout)
    answer = _report(line)
    kept = None
    if "error" not in answer:
        try:
            kept = KeptSandbox(keeper_pid=proc.pid, job_id=spec.job_id, **answer)
        except TypeError:
            answer = {"error": f"the keeper's report is not one: {line[:300]!r}"}
    if kept is None:
        # Whatever the keeper started goes with it: it stops its box on SIGTERM.
        _end(proc)
        said = drop_log(state_root, spec.job_id)
        raise SandboxStartError(
            f"sandbox for job {spec.job_id} did not start: {answer['error']}"
            + (f" (keeper log: {said})" if said else "")
        )
    proc.stdout.close()
    return kept


def _report(line: str) -> dict[str, Any]:
    """The keeper's first line read as its report (an object), or `{"error": ...}` saying
    what came instead."""
    if not line:
        return {"error": "the keeper exited without a word"}
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return {"error": f"the keeper's first line is not its report: {line[:300]!r}"}
    return answer


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        _end(proc)
        raise SandboxStartError(f"the sandbox was not ready within {timeout:.0f}s")
    return result[0].decode().strip() if result else ""


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def release(kept: KeptSandbox | dict[str, Any], timeout: float = 20.0) -> None:
    """Stop the sandbox: ask its keeper to stop it and wait until the keeper is gone.

    Safe to call twice and from any process on the keeper's host; a pid that no longer
    belongs to this keeper is left alone.
    """
    info = kept.as_dict() if isinstance(kept, KeptSandbox) else kept
    try:
        _stop_keeper(int(info["keeper_pid"]), str(info["job_id"]), timeout)
    finally:
        if info.get("state_dir"):  # a record without one has no log here (the reaper's part)
            drop_log(Path(str(info["state_dir"])).parent, str(info["job_id"]))


def log_path(state_root: Path, job_id: str) -> Path:
    """The keeper's log (its stderr): it lives as long as the keeper."""
    return state_root / f"keeper-{job_id}.log"


def drop_log(state_root: Path, job_id: str) -> str:
    """Remove the keeper's log; returns the end of what it said."""
    path = log_path(state_root, job_id)
    try:
        with open(path, "rb") as file:
            file.seek(max(0, path.stat().st_size - 2000))
            said = file.read().decode(errors="replace").strip()
        path.unlink()
    except OSError:
        return ""
    return said


def _stop_keeper(pid: int, job_id: str, timeout: float) -> None:
    if not _is_keeper(pid, job_id):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _is_keeper(pid, job_id):
        time.sleep(0.02)
    if _is_keeper(pid, job_id):
        os.kill(pid, signal.SIGKILL)


def is_kept(kept: KeptSandbox | dict[str, Any]) -> bool:
    """Whether the sandbox's keeper still runs (asked on the node that holds it)."""
    record = kept.as_dict() if isinstance(kept, KeptSandbox) else kept
    return _is_keeper(int(record["keeper_pid"]), str(record["job_id"]))


def _is_keeper(pid: int, job_id: str) -> bool:
    """True while `pid` is alive and is the keeper of `job_id`'s sandbox (pids get reused)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    if status.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return f"{KEEPER_LABEL}={job_id}".encode() in environ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.keeper", description=__doc__)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--state-root", type=Path, required=True)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        spec = spec_from_json(sys.stdin.read())
        box = get_backend(args.backend).create(spec, args.state_root)
        box.start(tool_server=True)
        control = _Control(box)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(
        json.dumps(
            {
                "id": box.id,
                "backend": box.backend,
                "state_dir": str(box.state_dir),
                "socket_path": str(box.socket_path),
                "workspace": str(box.workspace),
                "tool_socket": _socket_record(box),
            }
        ),
        flush=True,
    )
    sys.stdout.close()
    deadline = time.monotonic() + spec.lease_seconds
    try:
        while not stop.wait(0.5):
            # A halted box is over by design (its files wait for grading); any other box
            # that is not running died. A box whose state dir is gone was reaped or released
            # by another process (a halted one has nothing left running to tell).
            over = not (box.halted or box.alive()) or not box.state_dir.is_dir()
            if time.monotonic() > deadline or over:
                break
    finally:
        control.close()
        box.stop()
        drop_log(args.state_root, spec.job_id)
    return 0


# --- Fresh commands over the box's files, asked for by workers (grading) ------------------

CONTROL_SOCKET = "keeper.sock"
"""The keeper's control socket, in the sandbox's state dir (the service's alone, mode 0700;
no box sees it)."""
_REQUEST_LIMIT = 64 << 20


class _Control:
    """The keeper's control socket: one JSON request per connection, one JSON answer.

    `{"op": "exec", "argv": [...], "timeout": s, "max_output": n, "input": text|null,
    "env": {...}|null, "halt": bool}` halts the box first when asked (every process the
    agent had is killed, its files stay), then runs `argv` as a fresh `exec` box (with the
    box's clean environment plus `env`) and answers its `ExecResult`; `{"op": "harness",
    "argv", "timeout", "max_output", "env", "port"}` runs `argv` the same way under the model
    endpoint's forwarder (`sandbox.llmforward`), never halting; `{"op": "halt"}` only halts
    (and so ends a running `exec` or harness, which then answers). Errors answer
    `{"error": "..."}`.
    """

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        self.path = box.state_dir / CONTROL_SOCKET
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if peer_credentials(conn)[1] != os.geteuid():
                    return  # only the service's own processes may ask
                request = json.loads(_read_all(conn, _REQUEST_LIMIT))
                answer = self._answer(request)
            except Exception as exc:  # one bad request never takes the keeper down
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(answer).encode() + b"\n")

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op not in ("exec", "harness", "halt"):
            return {"error": f"unknown op {op!r}"}
        if op == "halt" or (op == "exec" and request.get("halt", True)):
            self.box.halt()
        if op == "halt":
            return {"halted": True}
        argv, env = request["argv"], request.get("env") or {}
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            return {"error": "argv must be a non-empty list of strings"}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            return {"error": "env must map strings to strings"}
        if op == "harness":
            if not self.box.spec.endpoint:
                return {"error": "the sandbox was made without a model endpoint"}
            socket_path = self.box.endpoint_socket_inside()
            argv = forwarder_argv(sys.executable, socket_path, argv, int(request.get("port", 0)))
        text = request.get("input") if op == "exec" else None
        result = self.box.exec(
            argv,
            timeout=float(request.get("timeout", 60.0)),
            input=None if text is None else str(text).encode(),
            env=env,
            max_output=int(request.get("max_output", EXEC_OUTPUT_LIMIT)),
        )
        return dataclasses.asdict(result)


def _read_all(conn: socket.socket, limit: int) -> bytes:
    """The request: everything up to the first newline (or the peer's end of writing)."""
    data = bytearray()
    while b"\n" not in data:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError(f"request longer than {limit} bytes")
    return bytes(data.split(b"\n", 1)[0])


def _control_call(
    kept: KeptSandbox | dict[str, Any], request: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Send `request` to the keeper of `kept` and return its answer.

    The socket is checked before anything is sent: a socket file (not a link) in the state
    dir, served by the keeper's own process (peer pid); else SandboxSecurityError.
    """
    info = kept.as_dict() if isinstance(kept, KeptSandbox) else kept
    path = Path(str(info["state_dir"])) / CONTROL_SOCKET
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SandboxError(f"the keeper of job {info['job_id']} is gone ({path}: {exc})") from exc
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxSecurityError(f"{path} is not the keeper's socket (mode {st.st_mode:o})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(str(path))
        except OSError as exc:
            raise SandboxError(f"cannot reach the keeper of job {info['job_id']}: {exc}") from exc
        pid = peer_credentials(conn)[0]
        if pid != int(info["keeper_pid"]):
            raise SandboxSecurityError(
                f"{path} is served by pid {pid}, not the keeper (pid {info['keeper_pid']})"
            )
        conn.sendall(json.dumps(request).encode() + b"\n")
        try:
            raw = _read_all(conn, 1 << 30)
        except TimeoutError as exc:
            raise SandboxError(f"the keeper of job {info['job_id']} did not answer") from exc
    if not raw:
        raise SandboxError(f"the keeper of job {info['job_id']} closed without an answer")
    answer: dict[str, Any] = json.loads(raw)
    if "error" in answer:
        raise SandboxError(f"sandbox of job {info['job_id']}: {answer['error']}")
    return answer


def halt(kept: KeptSandbox | dict[str, Any], timeout: float = 30.0) -> None:
    """Kill every process of the kept box; its files stay until it is released."""
    _control_call(kept, {"op": "halt"}, timeout)


def exec_fresh(
    kept: KeptSandbox | dict[str, Any],
    argv: list[str],
    *,
    timeout: float = 60.0,
    input: str | None = None,
    max_output: int = EXEC_OUTPUT_LIMIT,
    halt: bool = True,
    env: dict[str, str] | None = None,
) -> ExecResult:
    """Run `argv` in a fresh box over the kept box's files (same root, binds, workspace,
    limits; its own /tmp), after halting the box when `halt`: nothing the agent started,
    stopped or replaced takes part. Its environment is the box's clean one plus `env`."""
    request = {"op": "exec", "argv": argv, "timeout": timeout, "input": input,
               "max_output": max_output, "halt": halt, "env": env}  # fmt: skip
    answer = _control_call(kept, request, timeout + 30.0)
    return ExecResult(**answer)


def run_harness(
    kept: KeptSandbox | dict[str, Any],
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
    timeout: float = 3600.0,
    max_output: int = EXEC_OUTPUT_LIMIT,
    port: int = 0,
) -> ExecResult:
    """Run the agent harness `argv` in a fresh box over the kept box's files (its root,
    binds, workspace, limits and network; the box is not halted) and wait for it.

    The harness runs under the forwarder (`sandbox.llmforward`), in the same box, which
    listens on the box's 127.0.0.1:`port` (0: a free one) and relays to the job's endpoint
    socket (`sandbox.endpointdir`; the sandbox needs `SandboxSpec.endpoint`). The harness's
    environment is the box's clean one plus `env`, the job's key as `OPENAI_API_KEY` and
    `ANTHROPIC_API_KEY` when `api_key` is given, and `OPENAI_BASE_URL`
    (`http://127.0.0.1:PORT/v1`) and `ANTHROPIC_BASE_URL` (`http://127.0.0.1:PORT`) on the
    forwarder's port. Its stdout and stderr are cut past `max_output` bytes each; the
    returncode is the harness's (128+n for signal n). After `timeout` seconds it is killed
    (`timed_out`); `halt(kept)` from another thread kills it too, and this then returns
    (returncode -9)."""
    variables = {**(key_env(api_key) if api_key is not None else {}), **(env or {})}
    request = {"op": "harness", "argv": argv, "timeout": timeout, "max_output": max_output,
               "env": variables, "port": port}  # fmt: skip
    answer = _control_call(kept, request, timeout + 30.0)
    return ExecResult(**answer)


def _socket_record(box: Sandbox) -> dict[str, int] | None:
    identity = getattr(box, "socket_identity", None)
    return identity.as_dict() if isinstance(identity, SocketIdentity) else None


if __name__ == "__main__":
    sys.exit(main())
