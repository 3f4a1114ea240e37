"""Terminal output made fit for a model: escape sequences removed, size capped."""

from __future__ import annotations

import re
from typing import Final

DEFAULT_OUTPUT_LIMIT: Final = 100_000
"""Bytes of output a tool call returns before the middle is cut out."""

# Every alternative starts with ESC, so the engine can skip ahead to the next ESC quickly.
_ESCAPES = re.compile(
    rb"""
    \x1b(?:
        \][^\x07\x1b]*(?:\x07|\x1b\\)?      # OSC: window titles, hyperlinks
      | [P^_X][^\x1b]*(?:\x1b\\)?          # DCS, PM, APC, SOS strings
      | \[[0-?]*[ -/]*[@-~]                # CSI: colours, cursor movement, modes
      | [()*+][0-9A-Za-z]                  # character set selection
      | [ -/]*[0-~]                        # other escapes (keypad modes, ...)
    )
    """,
    re.VERBOSE,
)
_C1_CSI = re.compile(rb"\xc2\x9b[0-?]*[ -/]*[@-~]")  # the 8-bit CSI, as UTF-8
# Control bytes other than tab, newline and carriage return (handled per line). They never
# occur inside a UTF-8 multi-byte sequence, so deleting them from the bytes is safe.
_CONTROL_BYTES = bytes([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])


def clean_terminal_output(data: bytes) -> str:
    """Terminal output as text without ANSI escape sequences or stray control characters.

    CRLF becomes LF, and a line redrawn with carriage returns (a progress bar) keeps only
    what a terminal would finally show: its last non-empty segment. Undecodable bytes
    become U+FFFD. Each step is skipped by a fast scan when there is nothing for it to do.
    """
    if b"\x1b" in data:
        data = _ESCAPES.sub(b"", data)
    if b"\xc2\x9b" in data:
        data = _C1_CSI.sub(b"", data)
    text = data.translate(None, _CONTROL_BYTES).decode("utf-8", errors="replace")
    if "\r" not in text:
        return text
    text = text.replace("\r\n", "\n")
    if "\r" not in text:
        return text
    lines = text.split("\n")
    for index, line in enumerate(lines):
        if "\r" in line:
            segments = [segment for segment in line.split("\r") if segment]
            lines[index] = segments[-1] if segments else ""
    return "\n".join(lines)


def truncation_marker(cut: int, kept_head: int, kept_tail: int, total: int) -> str:
    return (
        f"\n[... output truncated: {cut} of {total} bytes cut; "
        f"showing the first {kept_head} and the last {kept_tail} bytes ...]\n"
    )


class CappedBuffer:
    """Bytes of unbounded length kept as a head and a tail of bounded size.

    Memory stays near `limit` however much is fed; `render()` joins head and tail around a
    marker that says how much was cut.
    """

    def __init__(self, limit: int = DEFAULT_OUTPUT_LIMIT) -> None:
        self.limit = max(limit, 2)
        self.head_size = self.limit // 2
        self.tail_size = self.limit - self.head_size
        self.total = 0
        self._head: bytes | None = None
        self.data = bytearray()
        """Everything fed since the head was frozen (all of it while under the limit)."""

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if self._head is None and len(self.data) > self.limit:
            self._head = bytes(self.data[: self.head_size])
            del self.data[: self.head_size]
        # Compact only when well past the tail size, so a fast stream does not copy per chunk.
        if self._head is not None and len(self.data) > 2 * self.tail_size + 65536:
            del self.data[: len(self.data) - self.tail_size - 65536]

    def trim_end(self, keep: int) -> bytes:
        """Remove and return whatever follows the first `keep` bytes of `data`."""
        rest = bytes(self.data[keep:])
        self.total -= len(rest)
        del self.data[keep:]
        return rest

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def render(self) -> tuple[bytes, bool]:
        """The kept bytes with a truncation marker in the middle, and whether any were cut."""
        if self._head is None:
            return bytes(self.data), False
        tail = bytes(self.data[-self.tail_size :]) if self.tail_size else b""
        cut = self.total - len(self._head) - len(tail)
        if cut <= 0:
            return self._head + bytes(self.data), False
        marker = truncation_marker(cut, len(self._head), len(tail), self.total).encode()
        return self._head + marker + tail, True
