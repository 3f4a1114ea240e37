"""The tool server: bash, ipython, editor and finish behind one Unix socket.

One server runs inside each sandbox, for one job. Tool state (the shell, the kernel, the
editor's undo history, the finish result) belongs to the server, not to a connection, so a
worker that reconnects finds the session as it left it. Requests on one connection are
answered in order; `ping` on another connection is answered even while a command runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.toolserver import protocol
from sandbox.toolserver.bash import BashError, BashSession
from sandbox.toolserver.editor import Editor, EditorError
from sandbox.toolserver.ipython import IPythonKernel, KernelError
from sandbox.toolserver.output import DEFAULT_OUTPUT_LIMIT
from sandbox.toolserver.processes import (
    become_subreaper,
    descendants,
    kill_all,
    reap_adopted,
    set_parent_death_signal,
)
from sandbox.toolserver.protocol import JSONObject, ProtocolError

log = logging.getLogger("rollserve.toolserver")

Handler = Callable[[JSONObject], Awaitable[JSONObject]]


@dataclass
class ServerConfig:
    socket_path: Path
    workdir: Path = field(default_factory=Path.cwd)
    tcp: tuple[str, int] | None = None
    """Also listen on TCP (for benchmarks only: inside a sandbox the socket is the door)."""
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    default_timeout: float = 120.0
    """Seconds a bash command or a cell may run when the call names no timeout."""
    max_frame: int = protocol.DEFAULT_MAX_FRAME
    shell: str = "/bin/bash"
    socket_fd: int | None = None
    """A Unix socket the host bound and passed in (bound, not listening): served instead of
    binding `socket_path`, which is then only a name for it."""


class ToolFailure(Exception):
    """A request the server answers with ``ok: false``."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


class ToolServer:
    """Serves tool calls until `stop()` (or SIGTERM, or the parent's death via `main`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.bash = BashSession(
            config.workdir, output_limit=config.output_limit, shell=config.shell
        )
        self.ipython = IPythonKernel(config.workdir, output_limit=config.output_limit)
        self.editor = Editor(config.workdir)
        self.finished = False
        self.finish_result: str | None = None
        self._handlers: dict[str, Handler] = {
            "ping": self._ping,
            "bash": self._bash,
            "ipython": self._ipython,
            "editor": self._editor,
            "finish": self._finish,
            "reset": self._reset,
        }
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._shell_start: asyncio.Future[None] | None = None

    # Running ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen; returns once the socket accepts connections. The shell starts meanwhile."""
        if self.config.socket_fd is not None:
            # Never inherited by the shell, the kernel or anything they start: a process of
            # the agent's holding the listening socket could accept the worker's calls.
            os.set_inheritable(self.config.socket_fd, False)
            # Nor taken from this process by one running as the same uid (ptrace,
            # pidfd_getfd, /proc/PID/fd): a process that is not dumpable refuses them.
            _not_dumpable()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=self.config.socket_fd)
            server = await asyncio.start_unix_server(self._serve_connection, sock=sock)
        else:
            path = self.config.socket_path
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket from an earlier run
            server = await asyncio.start_unix_server(self._serve_connection, path=str(path))
        self._servers.append(server)
        if self.config.tcp is not None:
            host, port = self.config.tcp
            self._servers.append(
                await asyncio.start_server(self._serve_connection, host=host, port=port)
            )
        self._shell_start = asyncio.ensure_future(self._start_shell())

    async def _start_shell(self) -> None:
        with contextlib.suppress(BashError):
            await self.bash.start()  # a failure is reported by the first bash call instead

    async def serve_until_stopped(self) -> None:
        await self._stopping.wait()
        await self.close()

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        """Stop listening, end connections, kill the shell, the kernel and their descendants."""
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(BaseException):
                await task
        if self._shell_start is not None:
            self._shell_start.cancel()
            with contextlib.suppress(BaseException):
                await self._shell_start
        await self.bash.close()
        await self.ipython.close()
        kill_all(descendants(os.getpid()))
        reap_adopted(keep=set())
        if self.config.socket_fd is None:  # a passed-in socket's path is the host's to remove
            with contextlib.suppress(FileNotFoundError):
                self.config.socket_path.unlink()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    message = await protocol.read_frame(reader, self.config.max_frame)
                except protocol.FrameTooLarge as exc:
                    # The rest of the stream cannot be trusted to be in step: answer, hang up.
                    await self._send(writer, protocol.error_response(None, exc.type, exc.message))
                    return
                except ProtocolError as exc:
                    await self._send(writer, protocol.error_response(None, exc.type, exc.message))
                    continue
                if message is None:
                    return
                await self._send(writer, await self.handle(message))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Shutdown. Ending normally rather than cancelled keeps asyncio's stream callback
            # from logging the cancellation as an error.
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, response: JSONObject) -> None:
        try:
            frame = protocol.encode_frame(response, self.config.max_frame)
        except protocol.FrameTooLarge as exc:
            frame = protocol.encode_frame(
                protocol.error_response(
                    response.get("id"), protocol.INTERNAL_ERROR, f"response too large: {exc}"
                )
            )
        writer.write(frame)
        await writer.drain()

    async def handle(self, message: JSONObject) -> JSONObject:
        """The response to one decoded request frame."""
        raw_id = message.get("id")
        request_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
        try:
            request_id, tool, args = protocol.parse_request(message)
            handler = self._handlers.get(tool)
            if handler is None:
                known = ", ".join(protocol.TOOLS)
                raise ToolFailure(protocol.UNKNOWN_TOOL, f"unknown tool {tool!r}; known: {known}")
            return protocol.ok_response(request_id, await handler(args))
        except (ProtocolError, ToolFailure) as exc:
            return protocol.error_response(request_id, exc.type, exc.message)
        except EditorError as exc:
            return protocol.error_response(request_id, protocol.EDITOR_ERROR, str(exc))
        except (BashError, KernelError) as exc:
            return protocol.error_response(request_id, protocol.INTERNAL_ERROR, str(exc))
        except Exception as exc:
            log.exception("tool call failed")
            return protocol.error_response(
                request_id, protocol.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
            )

    # Tools --------------------------------------------------------------------------------

    async def _ping(self, args: JSONObject) -> JSONObject:
        return {
            "pong": True,
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "finished": self.finished,
        }

    async def _bash(self, args: JSONObject) -> JSONObject:
        command = _string_arg(args, "command")
        timeout = _timeout_arg(args, self.config.default_timeout)
        return (await self.bash.run(command, timeout)).to_dict()

    async def _ipython(self, args: JSONObject) -> JSONObject:
        code = _string_arg(args, "code")
        timeout = _timeout_arg(args, self.config.default_timeout)
        return (await self.ipython.run(code, timeout)).to_dict()

    async def _editor(self, args: JSONObject) -> JSONObject:
        return self.editor.run(args)

    async def _finish(self, args: JSONObject) -> JSONObject:
        result = args.get("result")
        if result is not None and not isinstance(result, str):
            raise ToolFailure(protocol.INVALID_ARGUMENTS, "argument `result` must be a string")
        self.finished = True
        self.finish_result = result
        return {"finished": True}

    async def _reset(self, args: JSONObject) -> JSONObject:
        also_kernel = args.get("ipython", False)
        if not isinstance(also_kernel, bool):
            raise ToolFailure(protocol.INVALID_ARGUMENTS, "argument `ipython` must be a boolean")
        await self.bash.reset()
        restarted = await self.ipython.restart() if also_kernel else False
        return {"bash": True, "ipython": restarted}


def _not_dumpable() -> None:
    pr_set_dumpable = 4
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _string_arg(args: JSONObject, name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise ToolFailure(protocol.INVALID_ARGUMENTS, f"argument `{name}` must be a string")
    return value


def _timeout_arg(args: JSONObject, default: float) -> float:
    value = args.get("timeout", default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ToolFailure(
            protocol.INVALID_ARGUMENTS, "argument `timeout` must be a positive number of seconds"
        )
    return float(value)


async def _watch_process(server: ToolServer, parent: int) -> None:
    """Stop when the parent is gone; collect exited orphans adopted as a subreaper."""
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            log.info("parent process %d is gone; stopping", parent)
            server.stop()
            return
        keep = {pid for pid in (server.bash.pid, server.ipython.pid) if pid is not None}
        reap_adopted(keep)


async def run_server(config: ServerConfig) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP, or until the parent process exits."""
    parent = os.getppid()
    # The parent-death signal covers a crashed worker; the watch loop covers the race
    # where the parent died before the signal was armed.
    set_parent_death_signal(signal.SIGTERM)
    become_subreaper()
    server = ToolServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, server.stop)
    if os.getppid() != parent:
        return
    await server.start()
    watcher = asyncio.ensure_future(_watch_process(server, parent))
    try:
        await server.serve_until_stopped()
    finally:
        watcher.cancel()


def parse_tcp(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m sandbox.toolserver --socket PATH [...]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sandbox.toolserver", description="rollserve's in-sandbox tool server"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", type=Path, help="Unix socket to listen on")
    where.add_argument(
        "--socket-fd", type=int, help="listen on this inherited, bound Unix socket instead"
    )
    parser.add_argument("--tcp", type=parse_tcp, help="also listen on HOST:PORT (benchmarks)")
    parser.add_argument("--workdir", type=Path, default=None, help="tools start here")
    parser.add_argument(
        "--output-limit", type=int, default=DEFAULT_OUTPUT_LIMIT, help="bytes per tool output"
    )
    parser.add_argument("--default-timeout", type=float, default=120.0)
    parser.add_argument("--max-frame", type=int, default=protocol.DEFAULT_MAX_FRAME)
    parser.add_argument("--shell", default="/bin/bash")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="toolserver: %(message)s", stream=sys.stderr)
    workdir = (options.workdir or Path.cwd()).resolve()
    if not workdir.is_dir():
        parser.error(f"--workdir {workdir} is not a directory")
    config = ServerConfig(
        socket_path=options.socket or Path(f"/proc/self/fd/{options.socket_fd}"),
        socket_fd=options.socket_fd,
        workdir=workdir,
        tcp=options.tcp,
        output_limit=options.output_limit,
        default_timeout=options.default_timeout,
        max_frame=options.max_frame,
        shell=options.shell,
    )
    asyncio.run(run_server(config))
    return 0
