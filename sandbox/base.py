"""The sandbox interface: what a box is made of, how a command in it ended, and what every
backend provides.

A sandbox is a box an agent's commands run in: a root filesystem, a writable `/workspace`,
a private `/tmp`, resource limits, the network on or off, and the tool server listening on a
Unix socket in a directory bound from the host. *Where* the box lives is the backend's
business (`bwrap`, `apptainer`, `local`); *what runs in it* (the tool server) is not.

Every sandbox has a state directory on the host (`<state_root>/<id>/`) holding `meta.json`,
the socket directory and, unless one is given, the workspace (`sandbox.statedir`). Every
process the service starts for a box carries the labels `ROLLSERVE_SANDBOX_ID` and
`ROLLSERVE_SANDBOX_JOB` in its environment, so the reaper can find and kill what a crashed
worker left behind (`sandbox.procs`). Boxes that are host process trees share
`sandbox.process.ProcessSandbox`.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sandbox.procs import kill_box_processes

SOCKET_DIR_INSIDE = "/rollserve/sock"
SOCKET_INSIDE = f"{SOCKET_DIR_INSIDE}/tools.sock"
ENDPOINT_DIR = "llm"
"""The endpoint directory of a sandbox with `SandboxSpec.endpoint`, in its state dir."""
ENDPOINT_DIR_INSIDE = "/rollserve/llm"
"""Where the box sees its endpoint directory (`sandbox.endpointdir`)."""
ENDPOINT_SOCKET = "endpoint.sock"
"""The endpoint's Unix socket, in the endpoint directory."""
WORKSPACE_INSIDE = "/workspace"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXEC_OUTPUT_LIMIT = 8 << 20
"""Bytes of stdout and of stderr `Sandbox.exec` keeps by default; the rest is counted and cut."""

ALLOW_LOCAL_ENV = "ROLLSERVE_SANDBOX_ALLOW_LOCAL"
"""Set (1, true): backend `auto` may fall back to `local`, boxes without isolation, where no
other backend works here. Unset, it never does: tool-using jobs fail saying why."""
ALLOW_UNLIMITED_ENV = "ROLLSERVE_SANDBOX_ALLOW_UNLIMITED"
"""Set (1, true): a box whose memory and process limits this host cannot hold (no cgroups
for boxes) starts anyway, with per-process rlimits only. Unset, it does not start."""


def env_flag(name: str) -> bool:
    """True when the environment variable `name` says yes (`1`, `true`, `yes`, `on`)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the box."""

    host: Path
    inside: str
    read_only: bool = True


@dataclass(frozen=True)
class Limits:
    """Resource limits of the box. The first four are rlimits, so per process, except
    `processes`, which bounds the processes and threads of one box (of one `exec`, or of the
    tool server's box) where the box has a user namespace or a uid of its own. The `box_`
    and `disk_` ones hold for the box as a whole (its main box and every `exec` together)
    where the host enforces them (`sandbox.cgroups.enforced_limits`). None leaves a limit
    unset."""

    cpu_seconds: int | None = 600
    memory_bytes: int | None = 4 << 30
    """Address space of each process; where the box has no disk of its own, also the size
    cap of its /tmp and /dev/shm unless `disk_bytes` is set."""
    processes: int | None = 512
    file_size_bytes: int | None = 1 << 30
    box_memory_bytes: int | None = 4 << 30
    """Memory of the whole box: all its processes and the tmpfs pages they write (/tmp,
    /dev/shm, the box's own disk), counted in one cgroup; past it the kernel OOM-kills one of
    the box's processes."""
    box_pids: int | None = 512
    """Processes and threads of the whole box (cgroup `pids.max`); a fork past it fails."""
    box_cpu_shares: int | None = 1024
    """The box's weight against other boxes when the CPUs are contended (cgroup v1
    `cpu.shares`; v2 `cpu.weight` is derived from it, 1024 being 100)."""
    disk_bytes: int | None = 2 << 30
    """Bytes the workspace, /tmp and /dev/shm hold together (the box's own tmpfs); writes
    past it fail with ENOSPC. Without a disk of its own, the size cap of /tmp and /dev/shm
    each. Keep it below `box_memory_bytes`: those pages count against it too."""
    disk_inodes: int | None = 262_144
    """Files, directories and links the workspace, /tmp and /dev/shm hold together."""


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
    """A network namespace of the box's own (never the host's) with outbound access through
    the egress proxy (`sandbox.network`); False: loopback only."""
    egress: list[str] = field(default_factory=list)
    """With `network`: the hosts the box may connect to (`core.egress` rules: `host` or
    `host:port`); every other connection and name lookup is refused."""
    limits: Limits = Limits()
    lease_seconds: float = 3600.0
    """The reaper may kill the box this long after it was created."""
    workdir: str = WORKSPACE_INSIDE
    endpoint: bool = False
    """Give the box its job's model endpoint: the host makes `<state_dir>/llm/`, every box
    sees it read-only at `ENDPOINT_DIR_INSIDE`, and the host serves the endpoint on a Unix
    socket there (`sandbox.endpointdir`), which harnesses reach through `sandbox.llmforward`."""


@dataclass
class ExecResult:
    """How a one-off command in the box ended.

    `killed_by` names the limit the command ran into (`cpu_seconds`, `memory_bytes`,
    `processes`, `file_size_bytes`, `disk_bytes`, or `box_memory` / `box_pids` when the
    box's cgroup counted an OOM kill / a refused fork while it failed, `box_disk` /
    `box_inodes` when it failed with the box's own disk full) when its end shows one, else the
    signal that ended it (`SIGKILL` also when the timeout did: then `timed_out` is true),
    else None.
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


class SandboxSecurityError(Exception):
    """Something the host relies on to talk to a box, or to grade it, is not what the host
    made: a substituted socket, a process that is not the box's. Never a grade: the stage
    that meets it fails with this error (job error type `security`)."""


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
    halted: bool = False
    """The box's processes were killed on purpose (`Sandbox.halt`); its files stay."""
    cgroup: list[str] | None = None
    """The box's cgroup directories, one per hierarchy (`sandbox.cgroups`)."""
    disk: str | None = None
    """Host path of the box's own tmpfs (`sandbox.boxdisk`)."""

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
    def halt(self) -> None:
        """Kill every process of the box (the tool server, the agent's commands and whatever
        they left running) but keep the box's files, so `exec` can still run fresh commands
        over its workspace: what grading does once the agent's turns are over. A halted box
        is not `alive`. SandboxError once the box is stopped."""

    @property
    @abstractmethod
    def halted(self) -> bool:
        """True once `halt` ran."""

    @abstractmethod
    def alive(self) -> bool:
        """True while the started box is running."""

    def endpoint_socket_inside(self) -> str:
        """The path the box's processes reach the job's model endpoint at (`spec.endpoint`)."""
        return f"{ENDPOINT_DIR_INSIDE}/{ENDPOINT_SOCKET}"


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
