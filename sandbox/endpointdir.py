"""The job's model endpoint as its box reaches it: a Unix socket the host serves in the
sandbox's endpoint directory.

A box has no network, so the host (the RUN worker) serves the job's endpoint on a Unix socket
in `<state_dir>/llm/`, which a sandbox made with `SandboxSpec.endpoint` has: the service's
own directory (mode 0755: boxes read it, only the service writes it), bound read-only at
`/rollserve/llm` in the box's main process and in every `exec` box, and in no other sandbox's
(the state root, with every other sandbox's files, is out of every box's sight). Connecting to
a socket works through a read-only mount. The socket is given to the box's uid (mode 0600)
where boxes run as one of their own, so no other box's processes could connect to it even if
they saw it. Inside the box, `sandbox.llmforward` relays a harness's HTTP on its loopback to
the socket. Files the service puts in the directory (the task's instruction) are readable in
the box too.

    paths = endpoint_paths(kept["state_dir"])
    ... the server binds paths.socket (aiohttp: web.UnixSite(runner, str(paths.socket))) ...
    open_socket(paths, kept)            # now the box's processes may connect
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.base import (
    ENDPOINT_DIR,
    ENDPOINT_DIR_INSIDE,
    ENDPOINT_SOCKET,
    SandboxError,
    SandboxSecurityError,
)
from sandbox.statedir import read_info

__all__ = ["ENDPOINT_DIR_INSIDE", "EndpointPaths", "endpoint_paths", "open_socket"]

# The longest path a Unix socket address holds (sun_path is 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107


@dataclass(frozen=True)
class EndpointPaths:
    """Where a sandbox's endpoint lives on the host."""

    state_dir: Path
    directory: Path
    """`<state_dir>/llm/`: the box sees it read-only at `ENDPOINT_DIR_INSIDE`."""
    socket: Path
    """Where the endpoint listens; the box reaches it at `Sandbox.endpoint_socket_inside()`
    (`/rollserve/llm/endpoint.sock` but with the local backend, which has no mounts)."""


def endpoint_paths(state_dir: Path | str) -> EndpointPaths:
    """The endpoint's paths of the sandbox whose state dir is `state_dir`; SandboxError when
    the sandbox was made without `SandboxSpec.endpoint`, or the socket's path is too long for
    a Unix socket."""
    state = Path(state_dir)
    directory = state / ENDPOINT_DIR
    if directory.is_symlink() or not directory.is_dir():
        raise SandboxError(f"sandbox {state.name} was made without a model endpoint")
    socket_path = directory / ENDPOINT_SOCKET
    if len(str(socket_path)) > _SOCKET_PATH_MAX:
        raise SandboxError(f"the endpoint socket path {socket_path} is too long for a socket")
    return EndpointPaths(state, directory, socket_path)


def open_socket(paths: EndpointPaths, kept: Mapping[str, Any] | None = None) -> None:
    """Let the box's processes, and only them besides the service, connect to the socket the
    endpoint now listens on: mode 0600, owned by the box's uid where boxes run as one of their
    own (the service runs as root), else by the service's (a box in a user namespace is the
    service's user on the host). SandboxError when no socket is there; with `kept` (the job's
    sandbox record), SandboxSecurityError unless the state dir is that sandbox's."""
    try:
        st = os.lstat(paths.socket)
    except OSError as exc:
        raise SandboxError(f"the endpoint does not listen at {paths.socket}: {exc}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise SandboxError(f"{paths.socket} is not a socket (mode {st.st_mode:o})")
    info = read_info(paths.state_dir)
    if kept is not None and (info is None or info.id != kept.get("id")):
        raise SandboxSecurityError(f"{paths.state_dir} is not the state dir of {kept.get('id')}")
    if info is not None and info.uid is not None:
        os.lchown(paths.socket, info.uid, info.uid)
    os.chmod(paths.socket, 0o600)
