"""The sandbox interface, and the plumbing its backends share.

A sandbox is a box an agent's commands run in: a root filesystem, a writable `/workspace`,
a private `/tmp`, resource limits, the network on or off, and the tool server listening on a
Unix socket in a directory bound from the host. *Where* the box lives is the backend's
business (`bwrap`, `apptainer`, `local`); *what runs in it* (the tool server) is not.

Every sandbox has a state directory on the host (`<state_root>/<id>/`) holding `meta.json`,
the socket directory and, unless one is given, the workspace. Every process the service
starts for a box carries the labels `ROLLSERVE_SANDBOX_ID` and `ROLLSERVE_SANDBOX_JOB` in
its environment, so the reaper can find and kill what a crashed worker left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

LABEL_ID = "ROLLSERVE_SANDBOX_ID"
"""Environment label naming the sandbox a process belongs to."""
LABEL_JOB = "ROLLSERVE_SANDBOX_JOB"
"""Environment label naming the job of the sandbox a process belongs to."""

SOCKET_DIR_INSIDE = "/rollserve/sock"
SOCKET_INSIDE = f"{SOCKET_DIR_INSIDE}/tools.sock"
WORKSPACE_INSIDE = "/workspace"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXEC_OUTPUT_LIMIT = 8 << 20
"""Bytes of stdout and of stderr `Sandbox.exec` keeps by default; the rest is counted and cut."""

# The longest path a Unix socket address holds (sun_path is 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the box."""

    host: Path
    inside: str
    read_only: bool = True


@dataclass(frozen=True)
class Limits:
    """Resource limits of every process in the box: rlimits, so per process, except
    `processes`, which bounds the processes and threads of one box (of one `exec`, or of the
    tool server's box) where the box has a user namespace or a uid of its own. None leaves a
    limit unset."""

    cpu_seconds: int | None = 600
    memory_bytes: int | None = 4 << 30
    """Address space of each process; also the size cap of the box's /tmp and /dev/shm."""
    processes: int | None = 512
    file_size_bytes: int | None = 1 << 30


@dataclass
class SandboxSpec:
    """What a job's box is made of."""

    job_id: str
    root: str | None = None
    """bwrap: a root filesystem directory (None: the host's / read-only); apptainer: a .sif
    path or a docker:// (or other URI) reference."""
    workspace: Path | None = None
    """Host directory bound writable at /workspace (None: a fresh one in the state dir)."""
    binds: list[Bind] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    network: bool = False
    limits: Limits = Limits()
    lease_seconds: float = 3600.0
    """The reaper may kill the box this long after it was created."""
    workdir: str = WORKSPACE_INSIDE


@dataclass
class ExecResult:
    """How a one-off command in the box ended.

    `killed_by` names the limit the command ran into (`cpu_seconds`, `memory_bytes`,
    `processes`, `file_size_bytes`) when its end shows one, else the signal that ended it
    (`SIGKILL` also when the timeout did: then `timed_out` is true), else None.
    """

    returncode: int
    """The command's exit status; 128+n when signal n ended it inside a box, -n when the
    box itself was killed (-9 on a timeout)."""
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None


class SandboxError(RuntimeError):
    """A sandbox could not be created, started or used; the message says why."""


@dataclass
class SandboxInfo:
    """A sandbox as its `meta.json` describes it: enough to find and kill it from any process."""

    id: str
    job_id: str
    backend: str
    host: str
    created: float
    lease_expires: float
    state_dir: Path
    workspace: Path
    workspace_given: bool = False
    workspace_owner: tuple[int, int] | None = None
    """(uid, gid) a given workspace is handed back to when the box ran under another uid."""
    uid: int | None = None
    """Host uid the box's processes run as, when the backend switched to one."""
    pid: int | None = None
    """Host pid of the box's main process (None until started)."""
    pgid: int | None = None
    start_time: int | None = None
    """Start time of `pid` in clock ticks after boot, so a reused pid is never mistaken."""
    instance: str | None = None
    """Apptainer instance name."""

    def to_json(self) -> str:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["workspace"] = str(self.workspace)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SandboxInfo:
        data: dict[str, Any] = json.loads(text)
        data["state_dir"] = Path(data["state_dir"])
        data["workspace"] = Path(data["workspace"])
        if data.get("workspace_owner") is not None:
            data["workspace_owner"] = tuple(data["workspace_owner"])
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


class Sandbox(ABC):
    """One job's box. Not reusable: after `stop` it is gone."""

    id: str
    job_id: str
    spec: SandboxSpec
    backend: str
    state_dir: Path
    """Host directory of this sandbox: meta.json, sock/, workspace/ (unless given)."""
    socket_path: Path
    """Host path of the tool server's socket (inside the box: /rollserve/sock/tools.sock)."""
    workspace: Path
    """Host path of /workspace."""

    @abstractmethod
    def start(self, *, tool_server: bool = True, timeout: float = 30.0) -> None:
        """Start the box; with `tool_server`, run the tool server in it and return once its
        socket accepts connections. Idempotent while running; raises SandboxError (and stops
        the box) when it does not come up within `timeout` seconds."""

    @abstractmethod
    def exec(
        self,
        argv: list[str],
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        max_output: int = EXEC_OUTPUT_LIMIT,
    ) -> ExecResult:
        """Run one command in the same kind of box (same root, binds, limits, network,
        workspace), not through the tool server, and wait for it at most `timeout` seconds.
        On a timeout its process group is killed (with bwrap, every process it started: it
        has a pid namespace of its own, gone when the command ends). Output beyond
        `max_output` bytes per stream is cut with a marker."""

    @abstractmethod
    def stop(self) -> None:
        """Kill every process of the box and remove the state dir (a given workspace is
        kept). Idempotent, and safe while another thread runs `exec`."""

    @abstractmethod
    def alive(self) -> bool:
        """True while the started box is running."""


class SandboxBackend(ABC):
    """A place boxes can live."""

    name: ClassVar[str]

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") when boxes can be made here, else (False, why not)."""

    @abstractmethod
    def create(self, spec: SandboxSpec, state_root: Path) -> Sandbox:
        """Make a sandbox for `spec` with its state under `state_root` (not started yet)."""

    @classmethod
    def terminate(cls, info: SandboxInfo) -> None:
        """Kill every process of the sandbox `info` describes, from any process on its host."""
        kill_box_processes(info)


# --- Processes ------------------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks after boot, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields resume after the last ")".
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def process_matches(pid: int | None, start_time: int | None) -> bool:
    """True while `pid` runs and is the process that started at `start_time`."""
    if pid is None:
        return False
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in environ.split(b"\0")


def labelled_pids(sandbox_id: str) -> list[int]:
    """Pids of live processes labelled as belonging to `sandbox_id`."""
    needle = f"{LABEL_ID}={sandbox_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _environ_has(int(name), needle):
            found.append(int(name))
    return found


def kill_labelled(sandbox_id: str) -> int:
    """SIGKILL every process labelled with `sandbox_id`; returns how many were signalled.

    Each pid is pinned with a pidfd and its label checked again through it, so a pid reused
    between the scan and the kill is never hit.
    """
    needle = f"{LABEL_ID}={sandbox_id}".encode()
    killed = 0
    for pid in labelled_pids(sandbox_id):
        if pid == os.getpid():
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _environ_has(pid, needle):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return killed


def kill_group(pgid: int | None) -> None:
    """SIGKILL a process group, if it still exists."""
    if pgid is None or pgid <= 1:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def kill_box_processes(info: SandboxInfo, *, wait: float = 5.0) -> None:
    """Kill the box's main process group and every labelled process; wait until none is left."""
    if process_matches(info.pid, info.start_time):
        kill_group(info.pgid)
    deadline = time.monotonic() + wait
    while kill_labelled(info.id) and time.monotonic() < deadline:
        time.sleep(0.005)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Traces an exhausted limit leaves on stderr (bash, coreutils, Python, glibc, C++).
_LIMIT_TRACES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("processes", ("fork: retry", "fork: resource temporarily unavailable", "cannot fork",
                   "can't fork", "can't start new thread", "blockingioerror: [errno 11]")),
    ("memory_bytes", ("memoryerror", "cannot allocate memory", "bad_alloc", "out of memory",
                      "memory exhausted")),
    ("file_size_bytes", ("file too large",)),
    ("cpu_seconds", ("cpu time limit exceeded",)),
)  # fmt: skip
# bash's own words for a failed fork: specific enough to report even when the command exits
# 0 (a fork bomb's first shell returns at once; the box's end kills the rest).
_FORK_FAILURES = ("fork: retry", "fork: resource temporarily unavailable")
_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu_seconds", signal.SIGXFSZ: "file_size_bytes"}


def exit_signal(returncode: int) -> int | None:
    """The signal that ended a command: Popen's negative code, or a shell's (or bwrap's) 128+n."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + 65:
        return returncode - 128
    return None


def explain_end(returncode: int, stderr: str, timed_out: bool) -> str | None:
    """`ExecResult.killed_by` for a command that ended this way (see ExecResult)."""
    sig = exit_signal(returncode)
    if sig in _SIGNAL_LIMITS:
        return _SIGNAL_LIMITS[signal.Signals(sig)]
    lowered = stderr.lower()
    if returncode != 0 or timed_out:
        for limit, traces in _LIMIT_TRACES:
            if any(trace in lowered for trace in traces):
                return limit
    elif any(trace in lowered for trace in _FORK_FAILURES):
        return "processes"
    return None if sig is None else signal_name(sig)


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


# --- Inside the box -------------------------------------------------------------------------

# Run by the service's own interpreter (`python -S -I -c`) as the first program in the box:
# sets the rlimits, leaves root for the box's uid when asked, says it is ready on a pipe when
# given one, then execs the command (or waits forever when there is none). Only builtin and
# stdlib modules, no site-packages.
LAUNCHER = r"""
import os, resource, sys

def limit(which, value, slack):
    if value == "-":
        return
    soft = int(value)
    hard = soft + slack
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))

def main(args):
    cpu, memory, processes, file_size, uid, ready = args[:6]
    argv = args[7:]
    limit(resource.RLIMIT_CPU, cpu, 5)
    limit(resource.RLIMIT_AS, memory, 0)
    limit(resource.RLIMIT_NPROC, processes, 0)
    limit(resource.RLIMIT_FSIZE, file_size, 0)
    if uid != "-":
        n = int(uid)
        os.setgroups([])
        os.setresgid(n, n, n)
        os.setresuid(n, n, n)
    os.umask(0o022)
    if ready != "-":
        os.write(int(ready), b"ready\n")
        os.close(int(ready))
    if not argv:
        import signal
        while True:
            signal.pause()
    name = argv[0]
    dirs = [""] if "/" in name else os.environ.get("PATH", "/usr/bin:/bin").split(":")
    denied = None
    for d in dirs:
        try:
            os.execv(os.path.join(d, name) if d else name, argv)
        except PermissionError as exc:
            denied = exc
        except OSError:
            pass
    why = "permission denied" if denied else "no such file or directory"
    sys.stderr.write("sandbox: cannot run %s: %s\n" % (name, why))
    sys.stderr.flush()
    os._exit(126 if denied else 127)

main(sys.argv[1:])
"""


def launcher_argv(
    python: str,
    limits: Limits,
    command: list[str],
    uid: int | None = None,
    ready_fd: int | None = None,
) -> list[str]:
    """The command line that runs `command` under `limits` (as host `uid`, when given),
    writing a line to `ready_fd` once the limits are in place (so the box is up)."""

    def arg(value: int | None) -> str:
        return "-" if value is None else str(value)

    return [
        python, "-S", "-I", "-c", LAUNCHER,
        arg(limits.cpu_seconds), arg(limits.memory_bytes), arg(limits.processes),
        arg(limits.file_size_bytes), arg(uid), arg(ready_fd), "--", *command,
    ]  # fmt: skip


def toolserver_argv(python: str, socket_path: str, workdir: str) -> list[str]:
    """The tool server's command line."""
    return [python, "-m", "sandbox.toolserver", "--socket", socket_path, "--workdir", workdir]


def source_root() -> Path:
    """The directory holding the rollserve packages (so `-m sandbox.toolserver` imports)."""
    return Path(__file__).resolve().parent.parent


# Prefixes that hold the whole system, not just Python: never bound whole over a root.
_SYSTEM_PREFIXES = frozenset({Path("/"), Path("/usr"), Path("/usr/local")})


def service_paths() -> list[Path]:
    """Host paths a box needs read-only to run the service's interpreter and packages.

    A prefix of its own (a venv, pyenv, conda) is taken whole; of a system prefix (`/usr`)
    only Python's parts: the interpreter, the standard library and site-packages.
    """
    interpreter = Path(os.path.realpath(sys.executable))
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    prefixes.add(interpreter.parent.parent)
    candidates = {source_root()}
    candidates.update(p for p in prefixes if p not in _SYSTEM_PREFIXES)
    if prefixes & _SYSTEM_PREFIXES:
        candidates.add(interpreter)
        parts = [sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
        parts += site.getsitepackages()
        candidates.update(Path(p).resolve() for p in parts if os.path.exists(p))
    return sorted(p for p in candidates if not any(o != p and o in p.parents for o in candidates))


def box_env(
    spec: SandboxSpec,
    sandbox_id: str,
    extra: dict[str, str] | None = None,
    defaults: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a box's processes: sane defaults, the spec's, the call's, and the
    labels (last, so they cannot be overridden)."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    env.update(defaults or {})
    env.update(spec.env)
    env.update(extra or {})
    env[LABEL_ID] = sandbox_id
    env[LABEL_JOB] = spec.job_id
    return env


def host_env(sandbox_id: str, job_id: str) -> dict[str, str]:
    """The environment of the host-side process that makes a box (bwrap, apptainer)."""
    return {
        "PATH": os.environ.get("PATH", DEFAULT_PATH),
        "LANG": "C.UTF-8",
        LABEL_ID: sandbox_id,
        LABEL_JOB: job_id,
    }


def await_ready(fd: int, deadline: float) -> None:
    """Return once the launcher wrote its ready line to the pipe `fd`; raise SandboxError if
    the pipe closes first (the box died) or `deadline` (a monotonic time) passes."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxError("the box was not up in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            if os.read(fd, 64):
                return
            raise SandboxError("the box exited while it was being set up")


def wait_for_socket(path: Path, deadline: float, still_running: Callable[[], bool]) -> None:
    """Return once `path` accepts a connection; raise SandboxError when `still_running()`
    turns false or `deadline` (a monotonic time) passes."""
    while True:
        if path.exists():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(str(path))
                    return
                except OSError:
                    pass
        if not still_running():
            raise SandboxError("the box exited before its tool server listened")
        if time.monotonic() > deadline:
            raise SandboxError(f"the tool server did not listen on {path} in time")
        time.sleep(0.005)


# --- State directories ----------------------------------------------------------------------


def new_sandbox_id() -> str:
    return secrets.token_hex(6)


def meta_path(state_dir: Path) -> Path:
    return state_dir / "meta.json"


def read_info(state_dir: Path) -> SandboxInfo | None:
    """The sandbox recorded in `state_dir`, or None if there is none (or it is unreadable)."""
    try:
        return SandboxInfo.from_json(meta_path(state_dir).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write_info(info: SandboxInfo) -> None:
    """Record `info` in its state dir atomically (a reader never sees half a file)."""
    target = meta_path(info.state_dir)
    tmp = target.with_name(f".meta.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(info.to_json())
    os.replace(tmp, target)


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path` (created if missing); yields False if `blocking` is
    off and another process holds it, or if its directory is gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def state_lock(state_dir: Path) -> Path:
    return state_dir / ".lock"


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give `path` and everything under it to uid:gid (symlinks themselves, not targets)."""
    os.lchown(path, uid, gid)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(top, name), uid, gid)


def remove_tree(path: Path) -> None:
    """Remove `path` even where the box left directories without write permission."""

    def retry(func: Any, target: str, _exc: Any) -> None:
        parent = os.path.dirname(target)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if path.exists():
        shutil.rmtree(path, onerror=retry)


TOMBSTONE_PREFIX = ".gone-"
"""State dirs being removed are renamed to this prefix first."""


def release_state(info: SandboxInfo) -> None:
    """Hand a given workspace back to its owner and remove the state dir.

    Call it holding the state dir's lock. The dir is first renamed out of the way (atomic),
    so no other process can reach it, or its lock file, while it is being removed.
    """
    if info.workspace_given and info.workspace_owner is not None and info.workspace.exists():
        with contextlib.suppress(OSError):
            chown_tree(info.workspace, *info.workspace_owner)
    tombstone = info.state_dir.with_name(f"{TOMBSTONE_PREFIX}{info.id}-{secrets.token_hex(4)}")
    try:
        os.rename(info.state_dir, tombstone)
    except FileNotFoundError:
        return
    remove_tree(tombstone)


def prepare_state(
    spec: SandboxSpec,
    state_root: Path,
    backend: str,
    *,
    uid_choice: Callable[[set[int]], int] | None = None,
) -> SandboxInfo:
    """Create the state dir of a new sandbox (socket dir, workspace) and its meta.json.

    `uid_choice(used)` picks the host uid the box will run as, given the uids of the other
    sandboxes under `state_root`; the pick and the record happen under one lock, so two
    workers never give two boxes the same uid.
    """
    state_root = state_root.resolve()
    state_root.mkdir(parents=True, exist_ok=True)
    sandbox_id = new_sandbox_id()
    state_dir = state_root / sandbox_id
    state_dir.mkdir(mode=0o700)
    (state_dir / "sock").mkdir(mode=0o700)
    given = spec.workspace is not None
    workspace = state_dir / "workspace"
    if spec.workspace is not None:
        workspace = Path(spec.workspace).resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    now = time.time()
    info = SandboxInfo(
        id=sandbox_id,
        job_id=spec.job_id,
        backend=backend,
        host=socket.gethostname(),
        created=now,
        lease_expires=now + spec.lease_seconds,
        state_dir=state_dir,
        workspace=workspace,
        workspace_given=given,
    )
    if uid_choice is None:
        write_info(info)
        return info
    with locked(state_root / ".uids.lock"):
        used = {other.uid for other in _infos(state_root) if other.uid is not None}
        info.uid = uid_choice(used)
        write_info(info)
    assert info.uid is not None
    if given:
        stat = workspace.stat()
        info.workspace_owner = (stat.st_uid, stat.st_gid)
        write_info(info)
    chown_tree(workspace, info.uid, info.uid)
    os.chown(state_dir / "sock", info.uid, info.uid)
    return info


def _infos(state_root: Path) -> Iterator[SandboxInfo]:
    for entry in state_root.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            info = read_info(entry)
            if info is not None:
                yield info


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
            except BaseException as exc:
                self._fail_start(exc)

    def _fail_start(self, exc: BaseException) -> NoReturn:
        """Stop the half-started box and raise, with the end of its log when it has one."""
        tail = log_tail(self.state_dir / "box.log")
        self.stop()
        if isinstance(exc, SandboxError):
            raise SandboxError(f"{exc}; its log ends: {tail or '(empty)'}") from None
        raise exc

    def _main_command(self, tool_server: bool) -> list[str]:
        if not tool_server:
            return []
        return toolserver_argv(self.python, self._socket_inside(), self._workdir_inside())

    def _spawn_main(self, command: list[str], ready_fd: int | None) -> subprocess.Popen[bytes]:
        """Start the box's long-lived process (`command` inside it), logging to box.log."""
        argv, env = self._host_process(command, self._box_env(None), ready_fd)
        with open(self.state_dir / "box.log", "ab") as box_log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=box_log,
                stderr=box_log,
                env=env,
                cwd=self._host_cwd(),
                start_new_session=True,
                pass_fds=() if ready_fd is None else (ready_fd,),
            )

    def _launch_main(self, tool_server: bool, deadline: float) -> None:
        read_fd, write_fd = os.pipe() if self._passes_ready_fd() else (None, None)
        command = launcher_argv(
            self.python, self._limits(), self._main_command(tool_server), self.info.uid, write_fd
        )
        try:
            self._main = self._spawn_main(command, write_fd)
        finally:
            if write_fd is not None:
                os.close(write_fd)
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
        spawned: list[subprocess.Popen[bytes]] = []

        def track(proc: subprocess.Popen[bytes]) -> None:
            spawned.append(proc)
            with self._lock:
                self._execs.add(proc)
                stopped = self._stopped
            if stopped:  # stop() ran between our check and the spawn
                self._kill_exec(proc)

        try:
            return run_boxed(
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

    def alive(self) -> bool:
        main = self._main
        return main is not None and main.poll() is None and not self._stopped


def pick_free_uid(used: set[int], low: int, high: int) -> int:
    """A random uid in [low, high) that is not in `used`."""
    if high - low <= len(used):
        raise SandboxError(f"no free sandbox uid left in [{low}, {high})")
    while True:
        uid = low + secrets.randbelow(high - low)
        if uid not in used:
            return uid
