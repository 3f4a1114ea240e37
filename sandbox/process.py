"""Boxes that are host process trees (bwrap, local; apptainer builds on it): one command run
in its own process group with capped output and a timeout (`run_boxed`), and the sandbox
whose box is a main process plus one process tree per `exec` (`ProcessSandbox`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from sandbox.base import (
    EXEC_OUTPUT_LIMIT,
    SOCKET_INSIDE,
    ExecResult,
    Limits,
    Sandbox,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
)
from sandbox.cgroups import box_end, enter_argv, read_counters
from sandbox.limits import disk_state, note_box_end
from sandbox.procs import explain_end, kill_box_processes, kill_group, process_start_time
from sandbox.startup import (
    await_ready,
    bind_tool_socket,
    box_env,
    launcher_argv,
    record_tool_socket,
    toolserver_argv,
    wait_for_socket,
)
from sandbox.statedir import (
    SocketIdentity,
    locked,
    read_info,
    release_state,
    state_lock,
    write_info,
    write_socket_identity,
)

# The longest path a Unix socket address holds (sun_path is 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107


class _Collector(threading.Thread):
    """Reads a pipe to its end, keeping the first `limit` bytes and counting the rest."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.limit = fd, limit
        self.kept = bytearray()
        self.dropped = 0

    def run(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                room = self.limit - len(self.kept)
                self.kept += chunk[:room]
                self.dropped += max(0, len(chunk) - room)
        except OSError:
            pass

    def text(self) -> str:
        out = self.kept.decode("utf-8", "replace")
        if self.dropped:
            out += f"\n[... {self.dropped} more bytes of output cut]\n"
        return out


def run_boxed(
    argv: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    input: bytes | None,
    max_output: int,
    cwd: str | None = None,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
    kill: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> ExecResult:
    """Run `argv` in its own process group, feeding `input`, collecting capped output, and
    killing it (via `kill(proc)`, by default its group) when `timeout` passes."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise SandboxError(f"cannot run {argv[0]}: {exc}") from exc
    assert proc.stdout is not None and proc.stderr is not None
    if on_start is not None:
        on_start(proc)
    out = _Collector(proc.stdout.fileno(), max_output)
    err = _Collector(proc.stderr.fileno(), max_output)
    out.start()
    err.start()
    if input is not None:
        assert proc.stdin is not None
        stdin = proc.stdin
        threading.Thread(target=_feed, args=(stdin, input), daemon=True).start()
    timed_out = False
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        (kill or _kill_popen_group)(proc)
        returncode = proc.wait()
    # The pipes close once every process holding them is gone; a straggler outside the
    # box's reach must not hold the caller forever.
    out.join(5.0)
    err.join(5.0)
    proc.stdout.close()
    proc.stderr.close()
    stderr = err.text()
    return ExecResult(
        returncode=returncode,
        stdout=out.text(),
        stderr=stderr,
        timed_out=timed_out,
        killed_by=explain_end(returncode, stderr, timed_out),
    )


def _feed(stdin: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):
        stdin.write(data)
    with contextlib.suppress(OSError):
        stdin.close()


def _kill_popen_group(proc: subprocess.Popen[bytes]) -> None:
    kill_group(proc.pid)


def log_tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()


# --- Boxes that are host process trees (bwrap, local; apptainer builds on it) ---------------


class ProcessSandbox(Sandbox):
    """A sandbox whose box is a process tree the service starts: a main process (the tool
    server, or a placeholder that waits) and one process tree per `exec`.

    Subclasses say how a command becomes a host process in the box (`_host_process`) and,
    if they can, how to tell the box has been set up (`_await_setup`).
    """

    python: str = sys.executable

    def __init__(self, spec: SandboxSpec, info: SandboxInfo) -> None:
        self.spec = spec
        self.info = info
        self.id = info.id
        self.job_id = spec.job_id
        self.backend = info.backend
        self.state_dir = info.state_dir
        self.workspace = info.workspace
        self.socket_path = self.state_dir / "sock" / "tools.sock"
        self._lock = threading.RLock()
        self._main: subprocess.Popen[bytes] | None = None
        self._execs: set[subprocess.Popen[bytes]] = set()
        self._stopped = False
        self._halted = False
        self.socket_identity: SocketIdentity | None = None
        """The tool server's socket and process, recorded once it listens."""

    # What subclasses provide.

    @abstractmethod
    def _host_process(
        self, command: list[str], env: dict[str, str], ready_fd: int | None
    ) -> tuple[list[str], dict[str, str]]:
        """The host argv and environment that run `command` (already wrapped by the
        launcher) in the box, with `env` as its environment; `ready_fd` is to be kept open
        for it (it is the same number inside the box)."""

    def _limits(self) -> Limits:
        return self.spec.limits

    def _in_box_cgroup(self, argv: list[str]) -> list[str]:
        """The host command `argv`, entering the box's cgroup first when it has one."""
        return enter_argv(self.info.cgroup, argv) if self.info.cgroup else argv

    def _box_env(self, extra: dict[str, str] | None) -> dict[str, str]:
        return box_env(self.spec, self.id, extra)

    def _socket_inside(self) -> str:
        return SOCKET_INSIDE

    def _workdir_inside(self) -> str:
        return self.spec.workdir

    def _host_cwd(self) -> str:
        """Working directory of the host-side process."""
        return str(self.state_dir)

    def _passes_ready_fd(self) -> bool:
        """True if the box's main process inherits a pipe to say it is ready on."""
        return True

    def _passes_socket_fd(self) -> bool:
        """True if the host makes the tool server's socket (in a directory the box cannot
        reach) and the box's main process inherits it; else the tool server binds its socket
        path itself."""
        return False

    def _kill_exec(self, proc: subprocess.Popen[bytes]) -> None:
        kill_group(proc.pid)

    @classmethod
    def _terminate_box(cls, info: SandboxInfo) -> None:
        kill_box_processes(info)

    # The interface.

    def start(self, *, tool_server: bool = True, timeout: float = 30.0) -> None:
        if tool_server and len(str(self.socket_path)) > _SOCKET_PATH_MAX:
            raise SandboxError(
                f"the socket path {self.socket_path} is longer than a Unix socket allows "
                f"({_SOCKET_PATH_MAX} bytes): use a shorter state root"
            )
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._stopped:
                raise SandboxError(f"sandbox {self.id} was stopped; create a new one")
            if self.alive():
                return
            try:
                self._launch_main(tool_server, deadline)
            except BaseException as exc:
                self._fail_start(exc)
        if tool_server:
            # Unlocked: a stop() meanwhile (the job was cancelled) ends the wait at once.
            try:
                wait_for_socket(self.socket_path, deadline, self.alive)
                self._record_tool_socket()
            except BaseException as exc:
                self._fail_start(exc)

    def _record_tool_socket(self) -> None:
        """Record which socket file and which process are the tool server (toolsock.json),
        so clients can check both before they trust a connection."""
        main = self._main
        owner = main.pid if main is not None and self._passes_socket_fd() else None
        self.socket_identity = record_tool_socket(self.socket_path, owner)
        write_socket_identity(self.state_dir, self.socket_identity)

    def _fail_start(self, exc: BaseException) -> NoReturn:
        """Stop the half-started box and raise, with the end of its log when it has one."""
        tail = log_tail(self.state_dir / "box.log")
        self.stop()
        if isinstance(exc, SandboxError):
            raise SandboxError(f"{exc}; its log ends: {tail or '(empty)'}") from None
        raise exc

    def _main_command(self, tool_server: bool, socket_fd: int | None = None) -> list[str]:
        if not tool_server:
            return []
        return toolserver_argv(
            self.python, self._socket_inside(), self._workdir_inside(), socket_fd
        )

    def _spawn_main(
        self, command: list[str], ready_fd: int | None, socket_fd: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the box's long-lived process (`command` inside it), logging to box.log;
        it inherits `ready_fd` and `socket_fd` (same numbers) when given."""
        argv, env = self._host_process(command, self._box_env(None), ready_fd)
        argv = self._in_box_cgroup(argv)
        with open(self.state_dir / "box.log", "ab") as box_log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=box_log,
                stderr=box_log,
                env=env,
                cwd=self._host_cwd(),
                start_new_session=True,
                pass_fds=tuple(fd for fd in (ready_fd, socket_fd) if fd is not None),
            )

    def _launch_main(self, tool_server: bool, deadline: float) -> None:
        socket_fd = None
        if tool_server and self._passes_socket_fd():
            socket_fd = bind_tool_socket(self.socket_path)
        read_fd, write_fd = os.pipe() if self._passes_ready_fd() else (None, None)
        command = launcher_argv(
            self.python,
            self._limits(),
            self._main_command(tool_server, socket_fd),
            self.info.uid,
            write_fd,
        )
        try:
            self._main = self._spawn_main(command, write_fd, socket_fd)
        finally:
            # Only the box keeps the socket: no host process can accept on it.
            for fd in (write_fd, socket_fd):
                if fd is not None:
                    os.close(fd)
        pid = self._main.pid
        self.info.pid, self.info.pgid = pid, pid
        self.info.start_time = process_start_time(pid)
        write_info(self.info)
        if read_fd is not None:
            try:
                await_ready(read_fd, deadline)
            finally:
                os.close(read_fd)

    def exec(
        self,
        argv: list[str],
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        max_output: int = EXEC_OUTPUT_LIMIT,
    ) -> ExecResult:
        if not argv:
            raise ValueError("exec needs a command")
        with self._lock:
            if self._stopped or not self.state_dir.exists():
                raise SandboxError(f"sandbox {self.id} was stopped")
        command = launcher_argv(self.python, self._limits(), list(argv), self.info.uid)
        host_argv, host_env_ = self._host_process(command, self._box_env(env), None)
        host_argv = self._in_box_cgroup(host_argv)
        spawned: list[subprocess.Popen[bytes]] = []

        def track(proc: subprocess.Popen[bytes]) -> None:
            spawned.append(proc)
            with self._lock:
                self._execs.add(proc)
                stopped = self._stopped
            if stopped:  # stop() ran between our check and the spawn
                self._kill_exec(proc)

        before = read_counters(self.info.cgroup)
        try:
            result = run_boxed(
                host_argv,
                env=host_env_,
                timeout=timeout,
                input=input,
                max_output=max_output,
                cwd=self._host_cwd(),
                on_start=track,
                kill=self._kill_exec,
            )
        finally:
            with self._lock:
                self._execs.difference_update(spawned)
        if self.info.cgroup and not result.timed_out:
            after = read_counters(self.info.cgroup)
            result.killed_by = box_end(before, after, result.returncode, result.killed_by)
        if result.returncode != 0 and result.killed_by in (None, "disk_bytes"):
            full = disk_state(self.state_dir)
            if full:
                result.killed_by = f"box_{full[0][0]}"
        return result

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            procs = [p for p in (self._main, *self._execs) if p is not None]
        for proc in procs:
            self._kill_exec(proc)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
        with locked(state_lock(self.state_dir)) as held:
            info = read_info(self.state_dir) if held else None
            if info is not None:
                type(self)._terminate_box(info)
                release_state(info)

    def halt(self) -> None:
        with self._lock:
            if self._stopped:
                raise SandboxError(f"sandbox {self.id} was stopped")
            self._halted = True
            procs = [p for p in (self._main, *self._execs) if p is not None]
        with locked(state_lock(self.state_dir)) as held:
            info = read_info(self.state_dir) if held else None
            if info is None:
                raise SandboxError(f"sandbox {self.id} is gone")
            # Recorded first, so no reaper takes the box's end for a crash.
            info.halted = self.info.halted = True
            write_info(info)
        for proc in procs:
            self._kill_exec(proc)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
        type(self)._terminate_box(info)
        # What held the box during the agent's turns, for its trajectory.
        note_box_end(self.state_dir, info.cgroup)

    @property
    def halted(self) -> bool:
        return self._halted

    def alive(self) -> bool:
        main = self._main
        return main is not None and main.poll() is None and not self._stopped and not self._halted
