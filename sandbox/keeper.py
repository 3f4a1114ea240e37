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
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.backends import get_backend
from sandbox.base import Bind, Limits, Sandbox, SandboxSpec
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
    answer = json.loads(line) if line else {"error": "the keeper exited without a word"}
    if "error" in answer:
        _end(proc)
        said = drop_log(state_root, spec.job_id)
        raise SandboxStartError(
            f"sandbox for job {spec.job_id} did not start: {answer['error']}"
            + (f" (keeper log: {said})" if said else "")
        )
    proc.stdout.close()
    return KeptSandbox(keeper_pid=proc.pid, job_id=spec.job_id, **answer)


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
            if time.monotonic() > deadline or not box.alive():
                break
    finally:
        box.stop()
        drop_log(args.state_root, spec.job_id)
    return 0


def _socket_record(box: Sandbox) -> dict[str, int] | None:
    identity = getattr(box, "socket_identity", None)
    return identity.as_dict() if isinstance(identity, SocketIdentity) else None


if __name__ == "__main__":
    sys.exit(main())
