"""The tool server's wire format, shared by the server and its clients.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of UTF-8 JSON
holding one object. JSON rather than msgpack: every payload is text (commands, output, file
contents), the standard library encodes it in microseconds at these sizes, and a frame can
be read by eye in a packet capture. The length prefix lets either side read a whole message
with two exact reads, with no scanning for delimiters inside the payload.

Request:  ``{"id": int, "tool": str, "args": {...}}``
Response: ``{"id": int, "ok": true, "result": {...}}``
      or  ``{"id": int | null, "ok": false, "error": {"type": str, "message": str}}``

``id`` is chosen by the client and echoed back; it is ``null`` only when the request was so
malformed that its id could not be read. Requests on one connection are answered in order.

Tools (``args`` → ``result``):

- ``ping``: ``{}`` → ``{"pong": true, "protocol": 1, "pid": int, "finished": bool}``
- ``bash``: ``{"command": str, "timeout"?: float}`` → ``{"output": str, "exit_code": int |
  null, "timed_out": bool, "truncated": bool, "reset": bool}``
- ``ipython``: ``{"code": str, "timeout"?: float}`` → ``{"output": str, "status": "ok" |
  "error" | "timeout", "restarted": bool, "truncated": bool}``
- ``editor``: ``{"command": "view" | "create" | "str_replace" | "insert" | "undo_edit",
  "path": str, "view_range"?: [int, int], "file_text"?: str, "old_str"?: str,
  "new_str"?: str, "insert_line"?: int}`` → ``{"output": str}``; a refused command is an
  error of type ``EditorError`` whose message is written for the agent
- ``finish``: ``{"result"?: str | null}`` → ``{"finished": true}``
- ``reset``: ``{"ipython"?: bool}`` → ``{"bash": true, "ipython": bool}`` (a fresh shell;
  also a fresh kernel when asked and one was running)

A missing ``timeout`` means the server's default (``--default-timeout``, 120 s).
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, Final

JSONObject = dict[str, Any]

PROTOCOL_VERSION: Final = 1
HEADER: Final = struct.Struct(">I")
DEFAULT_MAX_FRAME: Final = 16 * 1024 * 1024
"""Largest payload either side accepts, in bytes (the header not counted)."""

TOOLS: Final = ("ping", "bash", "ipython", "editor", "finish", "reset")

# Error types carried in ``error.type``.
BAD_REQUEST: Final = "BadRequest"
"""The frame was not a JSON object of the request shape."""
FRAME_TOO_LARGE: Final = "FrameTooLarge"
"""A frame's declared length exceeded the limit; the server closes the connection after it."""
UNKNOWN_TOOL: Final = "UnknownTool"
INVALID_ARGUMENTS: Final = "InvalidArguments"
"""An argument was missing or of the wrong type."""
EDITOR_ERROR: Final = "EditorError"
"""The editor refused the command; the message is written for the agent to read."""
INTERNAL_ERROR: Final = "InternalError"
"""The tool failed in a way that is not the caller's fault."""


class ProtocolError(Exception):
    """A frame that cannot be turned into a message."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message


class FrameTooLarge(ProtocolError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            FRAME_TOO_LARGE, f"frame of {size} bytes exceeds the limit of {limit} bytes"
        )
        self.size = size
        self.limit = limit


def encode_frame(message: JSONObject, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """Header and payload of one message; raises FrameTooLarge past `max_size`."""
    payload = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()
    if len(payload) > max_size:
        raise FrameTooLarge(len(payload), max_size)
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes | bytearray, max_size: int = DEFAULT_MAX_FRAME) -> int:
    """The payload length a header announces; raises FrameTooLarge past `max_size`."""
    (size,) = HEADER.unpack(header)
    if size > max_size:
        raise FrameTooLarge(size, max_size)
    return int(size)


def decode_payload(payload: bytes) -> JSONObject:
    """The JSON object in a payload; raises ProtocolError(BadRequest) for anything else."""
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(BAD_REQUEST, f"payload is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_REQUEST, "payload must be a JSON object")
    return message


async def read_frame(
    reader: asyncio.StreamReader, max_size: int = DEFAULT_MAX_FRAME
) -> JSONObject | None:
    """The next message, or None when the peer closed the connection between frames.

    Raises FrameTooLarge (the stream is then out of step and must be closed), ProtocolError
    for a payload that is not a JSON object (the stream stays usable), and
    asyncio.IncompleteReadError when the peer hangs up inside a frame.
    """
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    payload = await reader.readexactly(frame_length(header, max_size))
    return decode_payload(payload)


class FrameBuffer:
    """Reassembles frames from bytes arriving in arbitrary pieces (for blocking sockets)."""

    def __init__(self, max_size: int = DEFAULT_MAX_FRAME) -> None:
        self.max_size = max_size
        self._data = bytearray()

    def feed(self, data: bytes | memoryview) -> None:
        self._data += data

    @property
    def waiting(self) -> bool:
        """Part of a frame has arrived and the rest has not."""
        return bool(self._data)

    def next_message(self) -> JSONObject | None:
        """The next complete message, or None until more bytes arrive."""
        if len(self._data) < HEADER.size:
            return None
        size = frame_length(self._data[: HEADER.size], self.max_size)
        end = HEADER.size + size
        if len(self._data) < end:
            return None
        payload = bytes(self._data[HEADER.size : end])
        del self._data[:end]
        return decode_payload(payload)


def make_request(request_id: int, tool: str, args: JSONObject) -> JSONObject:
    return {"id": request_id, "tool": tool, "args": args}


def ok_response(request_id: int | None, result: JSONObject) -> JSONObject:
    return {"id": request_id, "ok": True, "result": result}


def error_response(request_id: int | None, type_: str, message: str) -> JSONObject:
    return {"id": request_id, "ok": False, "error": {"type": type_, "message": message}}


def parse_request(message: JSONObject) -> tuple[int, str, JSONObject]:
    """`(id, tool, args)` of a request; raises ProtocolError(BadRequest) naming the bad field."""
    request_id = message.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(BAD_REQUEST, "request field `id` must be an integer")
    tool = message.get("tool")
    if not isinstance(tool, str):
        raise ProtocolError(BAD_REQUEST, "request field `tool` must be a string")
    args = message.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(BAD_REQUEST, "request field `args` must be an object")
    return request_id, tool, args
