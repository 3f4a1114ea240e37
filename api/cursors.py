"""Cursors of the results stream: where a line sits in its batch's log, as opaque text.

A cursor is `{entry}.{tag}`: `entry` is the id of the line's entry in the Redis stream the job
store appends each result line to exactly once (`ms-seq`, ordered, the same for every reader
and every gateway), `tag` eight hex digits derived from the batch id, so that a cursor of one
batch is refused by another rather than silently skipping or repeating lines.
"""

from __future__ import annotations

import hashlib
import re

CURSOR = re.compile(r"(?P<ms>[0-9]{1,20})-(?P<seq>[0-9]{1,20})\.(?P<tag>[0-9a-f]{8})")
"""The shape of a cursor."""

MAX_STREAM_PART = 2**64 - 1
"""The largest part of a Redis stream entry id."""


class CursorError(ValueError):
    """A cursor that is malformed, of another batch, or names no line of the batch."""


def batch_tag(batch_id: str) -> str:
    """Eight hex digits that tell cursors of `batch_id` from those of other batches."""
    return hashlib.blake2s(batch_id.encode(), digest_size=4).hexdigest()


def make_cursor(batch_id: str, entry_id: str) -> str:
    """The cursor of the line at stream entry `entry_id` of the batch's log."""
    return f"{entry_id}.{batch_tag(batch_id)}"


def parse_cursor(batch_id: str, cursor: str) -> str:
    """The stream entry id a cursor of `batch_id` points at; CursorError when it is not one."""
    match = CURSOR.fullmatch(cursor)
    if match is None:
        raise CursorError(
            f"{cursor[:100]!r} is not a cursor of the results stream: give the `cursor` of a "
            "line this stream sent, as sent"
        )
    if int(match["ms"]) > MAX_STREAM_PART or int(match["seq"]) > MAX_STREAM_PART:
        raise CursorError(f"{cursor!r} is not a cursor of the results stream: out of range")
    if match["tag"] != batch_tag(batch_id):
        raise CursorError(f"the cursor {cursor!r} belongs to the results of another batch")
    return f"{int(match['ms'])}-{int(match['seq'])}"
