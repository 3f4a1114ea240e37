"""Clients of the in-sandbox tool server (`sandbox.toolserver`), blocking and asyncio.

One connection is opened on first use and reused for every call; a call that fails on the
connection closes it, and the next call opens a new one (tool state lives in the server,
so it survives reconnecting).

    with ToolClient("/run/job-1/tools.sock") as tools:
        tools.call("bash", command="cd /workspace && ls", timeout=30)["output"]

A call waits up to the client's `timeout`, or longer when the call itself carries a
`timeout` argument (a bash command or a cell): then up to that plus `CALL_GRACE` seconds,
which leaves the server time to interrupt the command and answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

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


class ToolClient:
    """Blocking client; safe to share between threads (calls are serialised)."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout: float = 60,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.max_frame = max_frame
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
                raise ToolCallTimeout(f"no answer to {tool!r} in time") from exc
            except (OSError, protocol.ProtocolError) as exc:
                self._drop()
                raise ToolServerUnavailable(f"tool server connection failed: {exc}") from exc
            return _result(response, request_id)

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
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(str(self.socket_path))
                except OSError:
                    sock.close()
                    raise
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
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.max_frame = max_frame
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
                raise ToolCallTimeout(f"no answer to {tool!r} in time") from exc
            except (OSError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
                await self._drop()
                raise ToolServerUnavailable(f"tool server connection failed: {exc}") from exc
            if response is None:
                await self._drop()
                raise ToolServerUnavailable("tool server closed the connection")
            return _result(response, request_id)

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
                    reader, writer = await asyncio.open_unix_connection(
                        str(self.socket_path), limit=2**20
                    )
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
