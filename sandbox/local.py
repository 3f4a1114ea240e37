"""Boxes that are plain subprocesses in a directory of their own: NO isolation.

For development on machines without bubblewrap or Apptainer. The agent's commands run as
the service's user with its full access to the host; only the rlimits (CPU seconds, address
space, file size) apply, and the process-count limit does not (without a namespace of its
own, RLIMIT_NPROC would count every process of the service's user). `/workspace` in a spec's
workdir means the sandbox's workspace directory. Without a pid namespace, a process that
leaves its group (setsid) outlives an `exec` timeout; `stop` still finds it by its label.
The model endpoint's socket (`spec.endpoint`) is reached at its host path.
Every `create` says all this in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import ClassVar

from sandbox.base import (
    ENDPOINT_DIR,
    ENDPOINT_SOCKET,
    WORKSPACE_INSIDE,
    Limits,
    SandboxBackend,
    SandboxSpec,
)
from sandbox.process import ProcessSandbox
from sandbox.startup import box_env
from sandbox.statedir import prepare_state

log = logging.getLogger(__name__)


class LocalSandbox(ProcessSandbox):
    """A sandbox whose commands run directly on the host, in its own directory."""

    def _host_process(
        self, command: list[str], env: dict[str, str], ready_fd: int | None
    ) -> tuple[list[str], dict[str, str]]:
        return command, env

    def _limits(self) -> Limits:
        return dataclasses.replace(self.spec.limits, processes=None)

    def _box_env(self, extra: dict[str, str] | None) -> dict[str, str]:
        home = str(self.state_dir / "home")
        defaults = {"PATH": os.environ.get("PATH", ""), "HOME": home, "TMPDIR": home}
        return box_env(self.spec, self.id, extra, defaults=defaults)

    def _socket_inside(self) -> str:
        return str(self.socket_path)

    def endpoint_socket_inside(self) -> str:
        return str(self.state_dir / ENDPOINT_DIR / ENDPOINT_SOCKET)

    def _workdir_inside(self) -> str:
        workdir = self.spec.workdir
        if workdir == WORKSPACE_INSIDE or workdir.startswith(WORKSPACE_INSIDE + "/"):
            return str(self.workspace) + workdir[len(WORKSPACE_INSIDE) :]
        return workdir

    def _host_cwd(self) -> str:
        return self._workdir_inside()


class LocalBackend(SandboxBackend):
    """Plain subprocesses (see the module docstring): development only."""

    name: ClassVar[str] = "local"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def create(self, spec: SandboxSpec, state_root: Path) -> LocalSandbox:
        info = prepare_state(spec, state_root, self.name)
        (info.state_dir / "home").mkdir(mode=0o700)
        log.warning(
            "sandbox %s for job %s uses the LOCAL backend: NO ISOLATION. The agent's commands "
            "run as uid %d with full access to this host and its network. Development only: "
            "install bubblewrap or Apptainer for real sandboxes.",
            info.id,
            spec.job_id,
            os.geteuid(),
        )
        return LocalSandbox(spec, info)
