"""The record of the limits a sandbox ran into (`sandbox.limits`), without boxes: how its
sightings fold into one `LimitHit` per limit, what a tool call's answer adds, and the words
a full disk leaves on a command's stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.limits import LOG_NAME, MAX_BYTES, note_tool_call, read_limit_hits, record
from sandbox.procs import explain_end


def test_an_empty_record_names_no_limit(tmp_path: Path) -> None:
    assert read_limit_hits(tmp_path) == []


def test_sightings_add_up_and_counter_totals_replace_each_other(tmp_path: Path) -> None:
    record(tmp_path, "time", "a bash call ran out of time")
    record(tmp_path, "time", "a bash call ran out of time")
    record(tmp_path, "memory", "oom", count=2, counter=True)
    record(tmp_path, "memory", "oom", count=3, counter=True)
    hits = {hit.limit: hit.count for hit in read_limit_hits(tmp_path)}
    assert hits == {"memory": 3, "time": 2}


def test_hits_come_in_one_order_whatever_order_they_were_seen_in(tmp_path: Path) -> None:
    for limit in ("time", "processes", "inodes", "disk", "memory"):
        record(tmp_path, limit, "seen")
    assert [h.limit for h in read_limit_hits(tmp_path)] == [
        "memory", "disk", "inodes", "processes", "time"
    ]  # fmt: skip


def test_a_name_that_is_no_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a box limit"):
        record(tmp_path, "patience", "")


def test_lines_that_cannot_be_read_are_skipped(tmp_path: Path) -> None:
    (tmp_path / LOG_NAME).write_text('not json\n{"limit": "nope", "count": 1}\n{"limit": 4}\n')
    record(tmp_path, "disk", "full")
    assert [h.limit for h in read_limit_hits(tmp_path)] == ["disk"]


def test_the_record_stops_growing_at_its_cap_and_keeps_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / LOG_NAME).write_text('{"limit": "time", "count": 1}\n' + " " * MAX_BYTES + "\n")
    record(tmp_path, "disk", "full")
    assert [h.limit for h in read_limit_hits(tmp_path)] == ["time"]


def test_a_tool_call_that_timed_out_is_a_time_hit_and_one_that_got_no_answer_too(
    tmp_path: Path,
) -> None:
    note_tool_call(tmp_path, "bash", {"output": "", "exit_code": None, "timed_out": True})
    note_tool_call(tmp_path, "ipython", {"output": "", "status": "timeout"})
    note_tool_call(tmp_path, "bash", None)
    note_tool_call(tmp_path, "bash", {"output": "fine", "exit_code": 0, "timed_out": False})
    [hit] = read_limit_hits(tmp_path)
    assert (hit.limit, hit.count) == ("time", 3)


def test_a_box_without_a_disk_of_its_own_adds_no_disk_hit(tmp_path: Path) -> None:
    note_tool_call(tmp_path, "bash", {"output": "No space left on device", "exit_code": 1})
    assert read_limit_hits(tmp_path) == []


def test_a_command_failing_with_enospc_was_held_by_the_disk() -> None:
    stderr = "head: error writing 'standard output': No space left on device\n"
    assert explain_end(1, stderr, timed_out=False) == "disk_bytes"
    assert explain_end(0, stderr, timed_out=False) is None
