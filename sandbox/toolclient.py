"""Clients of the in-sandbox tool server (`sandbox.toolserver`), blocking and asyncio.

One connection is opened on first use and reused for every call; a call that fails on the
connection closes it, and the next call opens a new one (tool state lives in the server,
so it survives reconnecting).

    with ToolClient("/run/job-1/tools.sock") as tools:
        tools.call("bash", command="cd /workspace && ls", timeout=30)["output"]

A call waits up to the client's `timeout`, or longer when the call itself carries a
`timeout` argument (a bash command or a cell): then up to that plus `CALL_GRACE` seconds,
which leaves the server time to interrupt the command and answer.

A sandbox's socket (`<state_dir>/sock/tools.sock`) is checked on every connect against what
the host recorded when its tool server started (`toolsock.json`, or `expect=`): the path is
that very socket, not a link, and the process listening is the tool server. A mismatch
raises ToolSocketUntrusted before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import socket
import stat
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from sandbox.base import SandboxSecurityError
from sandbox.limits import note_tool_call
from sandbox.startup import peer_credentials
from sandbox.statedir import SOCKET_RECORD, SocketIdentity, meta_path, read_socket_identity
from sandbox.toolserver import protocol
from sandbox.toolserver.protocol import JSONObject

CALL_GRACE = 15.0
"""Seconds a call waits beyond its own `timeout` argument (for interrupt and recovery)."""


class ToolClientError(Exception):
    """Base of the errors raised by tool clients."""


class ToolError(ToolClientError):
    """The server answered ``ok: false``."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message


class ToolServerUnavailable(ToolClientError):
    """No answer: the socket is missing or refused, the connection broke, or time ran out."""


class ToolCallTimeout(ToolServerUnavailable):
    """The server did not answer a call in time (the connection is dropped)."""


class ToolSocketUntrusted(SandboxSecurityError):
    """The socket or the process behind it is not the box's tool server, as the host recorded
    it when the server started: a symlink, another socket, or another process listening. Not
    a ToolClientError, so nothing that handles a broken tool call mistakes it for one (or
    turns it into a grade); the message says what did not match."""


Expected = SocketIdentity | dict[str, Any] | None
"""What a client checks a connection against: the recorded identity, or None to look it up
(`<state_dir>/toolsock.json` when the socket is a sandbox's `<state_dir>/sock/tools.sock`)."""


def expected_identity(socket_path: Path, expect: Expected = None) -> SocketIdentity | None:
    """The identity a connection to `socket_path` must have, or None when there is none to
    check (a socket outside any sandbox's state dir: tests, benchmarks).

    A socket in a sandbox's state dir (one with a meta.json) must have a record; a missing
    one raises ToolSocketUntrusted.
    """
    if isinstance(expect, SocketIdentity):
        return expect
    if expect is not None:
        return SocketIdentity.from_dict(expect)
    state_dir = sandbox_state_dir(socket_path)
    if state_dir is None:
        return None
    identity = read_socket_identity(state_dir)
    if identity is None:
        raise ToolSocketUntrusted(
            f"no record of the tool server behind {socket_path} ({state_dir / SOCKET_RECORD})"
        )
    return identity


def connect_verified(socket_path: Path, identity: SocketIdentity, timeout: float) -> socket.socket:
    """A connection to the tool server at `socket_path`, after checking that the path is the
    socket the host recorded (not a symlink, same device and inode; the directory opened with
    O_NOFOLLOW and the socket reached through that descriptor, so nothing is swapped in
    between) and that the process listening is the recorded one (SO_PEERCRED pid and uid).

    Raises ToolSocketUntrusted on any mismatch, OSError when it cannot connect.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(socket_path.parent, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ToolSocketUntrusted(
                f"the socket directory {socket_path.parent} is not a directory: {exc}"
            ) from exc
        raise
    try:
        st = os.stat(socket_path.name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(socket_path.name, dir_fd=dir_fd)
            raise ToolSocketUntrusted(f"{socket_path} is a symlink (to {target}), not the socket")
        if not stat.S_ISSOCK(st.st_mode):
            raise ToolSocketUntrusted(f"{socket_path} is not a socket (mode {st.st_mode:o})")
        if (st.st_dev, st.st_ino) != (identity.dev, identity.ino):
            raise ToolSocketUntrusted(
                f"{socket_path} is another socket (device {st.st_dev} inode {st.st_ino}) than "
                f"the tool server's (device {identity.dev} inode {identity.ino})"
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(f"/proc/self/fd/{dir_fd}/{socket_path.name}")
            pid, uid, _gid = peer_credentials(sock)
            if (pid, uid) != (identity.pid, identity.uid):
                raise ToolSocketUntrusted(
                    f"the process listening on {socket_path} (pid {pid}, uid {uid}) is not the "
                    f"box's tool server (pid {identity.pid}, uid {identity.uid})"
                )
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dir_fd)


def _connect_unix(path: Path, expect: Expected, timeout: float) -> socket.socket:
    """A connection to the server at `path`, verified when it has a recorded identity."""
    identity = expected_identity(path, expect)
    if identity is not None:
        return connect_verified(path, identity, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
    except BaseException:
        sock.close()
        raise
    return sock


AGENT_TOOLS = frozenset({"bash", "ipython", "editor"})
"""Calls after which the sandbox's limits are looked at (`sandbox.limits`)."""


def sandbox_state_dir(socket_path: Path) -> Path | None:
    """The state dir of the sandbox whose tool server listens at `socket_path` (None for a
    socket outside any sandbox's state dir)."""
    state_dir = socket_path.parent.parent
    if socket_path.parent.name != "sock" or not meta_path(state_dir).exists():
        return None
    return state_dir


def _note(socket_path: Path, tool: str, result: dict[str, Any] | None) -> None:
    if tool in AGENT_TOOLS and (state_dir := sandbox_state_dir(socket_path)) is not None:
        note_tool_call(state_dir, tool, result)


def _wait_for(args: dict[str, Any], timeout: float) -> float:
    requested = args.get("timeout")
    if isinstance(requested, int | float) and not isinstance(requested, bool):
        return max(timeout, float(requested) + CALL_GRACE)
    return timeout


def _result(response: JSONObject, request_id: int) -> JSONObject:
    if response.get("id") != request_id:
        raise ToolServerUnavailable(
            f"answer to request {response.get('id')} arrived while waiting for {request_id}"
        )
    if response.get("ok") is True:
        result = response.get("result")
        return result if isinstance(result, dict) else {}
    error = response.get("error") or {}
    raise ToolError(str(error.get("type", "Unknown")), str(error.get("message", "")))


def _noted(socket_path: Path, tool: str, response: JSONObject, request_id: int) -> JSONObject:
    """`_result`, once what the call ran into is recorded for the sandbox."""
    try:
        result = _result(response, request_id)
    except ToolError:
        _note(socket_path, tool, {})
        raise
    _note(socket_path, tool, result)
    return result


class ToolClient:
    """Blocking client; safe to share between threads (calls are serialised)."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout: float = 60,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        expect: Expected = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.max_frame = max_frame
        self.expect = expect
        self._address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        self._frames = protocol.FrameBuffer(max_frame)
        self._chunk = bytearray(65536)
        self._sock_timeout: float | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @classmethod
    def tcp(cls, host: str, port: int, *, timeout: float = 60) -> ToolClient:
        """A client of a server started with ``--tcp HOST:PORT``."""
        client = cls("", timeout=timeout)
        client._address = (host, port)
        return client

    def connect(self) -> None:
        """Open the connection now rather than on the first call."""
        with self._lock:
            self._ensure_connected()

    def call(self, tool: str, **args: Any) -> JSONObject:
        """The `result` object of one tool call.

        Raises ToolError when the server answers with an error, ToolServerUnavailable
        (ToolCallTimeout for a timeout) when it does not answer.
        """
        with self._lock:
            request_id = next(self._ids)
            frame = protocol.encode_frame(
                protocol.make_request(request_id, tool, args), self.max_frame
            )
            sock = self._ensure_connected()
            try:
                wait = _wait_for(args, self.timeout)
                deadline = time.monotonic() + wait
                self._set_timeout(sock, wait)
                sock.sendall(frame)
                response = self._receive(sock, deadline)
            except TimeoutError as exc:
                self._drop()
                _note(self.socket_path, tool, None)
                raise ToolCallTimeout(f"no answer to {tool!r} in time") from exc
            except (OSError, protocol.ProtocolError) as exc:
                self._drop()
                raise ToolServerUnavailable(f"tool server connection failed: {exc}") from exc
            return _noted(self.socket_path, tool, response, request_id)

    def ping(self) -> JSONObject:
        return self.call("ping")

    def wait_until_ready(self, timeout: float = 10.0, interval: float = 0.005) -> JSONObject:
        """Retry connecting and pinging until the server answers; returns the ping result."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ping()
            except ToolServerUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(interval)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> ToolClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _ensure_connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        try:
            if self._address is not None:
                sock = socket.create_connection(self._address, timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = _connect_unix(self.socket_path, self.expect, self.timeout)
        except OSError as exc:
            where = self._address or self.socket_path
            raise ToolServerUnavailable(f"cannot connect to tool server at {where}: {exc}") from exc
        self._sock = sock
        self._sock_timeout = sock.gettimeout()
        self._frames = protocol.FrameBuffer(self.max_frame)
        return sock

    def _receive(self, sock: socket.socket, deadline: float) -> JSONObject:
        view = memoryview(self._chunk)
        while True:
            message = self._frames.next_message()
            if message is not None:
                return message
            if self._frames.waiting:  # a large answer: bound the total wait, not each read
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("deadline passed")
                self._set_timeout(sock, remaining)
            # A reused buffer: allocating a large bytes object per read costs more than the read.
            received = sock.recv_into(view)
            if not received:
                raise ConnectionResetError("tool server closed the connection")
            self._frames.feed(view[:received])

    def _set_timeout(self, sock: socket.socket, timeout: float) -> None:
        # settimeout costs two fcntl calls; most calls use the same value as the last one.
        if timeout != self._sock_timeout:
            sock.settimeout(timeout)
            self._sock_timeout = timeout

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class AsyncToolClient:
    """asyncio client; concurrent calls on one client are serialised on its connection."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout: float = 60,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        expect: Expected = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.max_frame = max_frame
        self.expect = expect
        self._address: tuple[str, int] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @classmethod
    def tcp(cls, host: str, port: int, *, timeout: float = 60) -> AsyncToolClient:
        """A client of a server started with ``--tcp HOST:PORT``."""
        client = cls("", timeout=timeout)
        client._address = (host, port)
        return client

    async def connect(self) -> None:
        """Open the connection now rather than on the first call."""
        async with self._lock:
            await self._ensure_connected()

    async def call(self, tool: str, **args: Any) -> JSONObject:
        """The `result` object of one tool call (errors as for `ToolClient.call`)."""
        async with self._lock:
            request_id = next(self._ids)
            frame = protocol.encode_frame(
                protocol.make_request(request_id, tool, args), self.max_frame
            )
            reader, writer = await self._ensure_connected()
            try:
                async with asyncio.timeout(_wait_for(args, self.timeout)):
                    writer.write(frame)
                    await writer.drain()
                    response = await protocol.read_frame(reader, self.max_frame)
            except TimeoutError as exc:
                await self._drop()
                _note(self.socket_path, tool, None)
                raise ToolCallTimeout(f"no answer to {tool!r} in time") from exc
            except (OSError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
                await self._drop()
                raise ToolServerUnavailable(f"tool server connection failed: {exc}") from exc
            if response is None:
                await self._drop()
                raise ToolServerUnavailable("tool server closed the connection")
            return _noted(self.socket_path, tool, response, request_id)

    async def ping(self) -> JSONObject:
        return await self.call("ping")

    async def wait_until_ready(self, timeout: float = 10.0, interval: float = 0.005) -> JSONObject:
        """Retry connecting and pinging until the server answers; returns the ping result."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await self.ping()
            except ToolServerUnavailable:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(interval)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def __aenter__(self) -> AsyncToolClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _ensure_connected(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is not None and self._writer is not None:
            return self._reader, self._writer
        try:
            async with asyncio.timeout(self.timeout):
                if self._address is not None:
                    reader, writer = await asyncio.open_connection(*self._address)
                    sock = writer.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                else:
                    # A local connect does not block; the checks read two small records.
                    sock = _connect_unix(self.socket_path, self.expect, self.timeout)
                    sock.setblocking(False)
                    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**20)
        except (OSError, TimeoutError) as exc:
            where = self._address or self.socket_path
            raise ToolServerUnavailable(f"cannot connect to tool server at {where}: {exc}") from exc
        self._reader, self._writer = reader, writer
        return reader, writer

    async def _drop(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await writer.wait_closed()
