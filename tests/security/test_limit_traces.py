"""A box stopped or held by a limit says which, with real bubblewrap boxes.

The agent's tools run as in a job's RUN: through the tool server, each call followed by the
host's look at the box (`sandbox.toolclient`), and the box halted when the turns are over.
What the record then holds (`read_limit_hits`, the trajectory's `limits`) names the limit:
a disk written past its size, a disk out of inodes, a process killed for the box's memory, a
fork refused for its process limit, a command that ran out of time. A policy that only
prints the words a full disk would print is not recorded as held.

Needs root, cgroups for boxes and mounts (the box's own disk); skips saying why otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from core.schemas import LimitHit
from sandbox.base import Limits
from sandbox.boxdisk import can_mount
from sandbox.cgroups import host_cgroups
from sandbox.limits import read_limit_hits
from sandbox.process import ProcessSandbox
from sandbox.toolclient import ToolClient
from tests.support.sandbox import SandboxFactory

MiB = 1 << 20
Episode = Callable[..., list[LimitHit]]


@pytest.fixture
def episode(bwrap_sandbox: SandboxFactory, toolserver_available: None) -> Iterator[Episode]:
    """`episode([command, ...], **limits)`: the commands run as the agent's bash calls in a
    box with those limits, the box halted; what its record says."""
    cgroups, why = host_cgroups()
    if cgroups is None:
        pytest.skip(f"this host has no cgroups for boxes: {why}")
    mountable, why = can_mount()
    if not mountable:
        pytest.skip(f"boxes get no disk of their own here: {why}")

    def run(commands: list[str], *, timeout: float = 30, **limits: Any) -> list[LimitHit]:
        box = bwrap_sandbox(limits=Limits(**limits))
        assert isinstance(box, ProcessSandbox)
        box.start(tool_server=True)
        with ToolClient(box.socket_path, timeout=60) as tools:
            for command in commands:
                tools.call("bash", command=command, timeout=timeout)
        box.halt()
        return read_limit_hits(box.state_dir)

    yield run


def names(hits: list[LimitHit]) -> list[str]:
    return [hit.limit for hit in hits]


def test_a_box_written_past_its_disk_limit_says_so(episode: Episode) -> None:
    hits = episode(["head -c 20M /dev/zero > /workspace/fill"], disk_bytes=8 * MiB)
    assert names(hits) == ["disk"], hits
    assert "full" in hits[0].detail


def test_a_box_out_of_inodes_says_so(episode: Episode) -> None:
    hits = episode(["for i in $(seq 300); do : > /tmp/f$i || break; done"], disk_inodes=100)
    assert "inodes" in names(hits), hits


def test_a_box_whose_process_was_killed_for_memory_says_so(episode: Episode) -> None:
    hits = episode(
        ["python3 -c \"b = b'x' * (400 << 20)\""], box_memory_bytes=160 * MiB, disk_bytes=64 * MiB
    )
    assert names(hits) == ["memory"], hits
    assert hits[0].count >= 1


def test_a_box_refused_a_fork_says_so(episode: Episode) -> None:
    bomb = "for i in $(seq 80); do sleep 30 & done; wait"
    hits = episode([bomb], box_pids=32, processes=None, timeout=5)
    assert "processes" in names(hits), hits


def test_a_command_that_ran_out_of_time_says_so(episode: Episode) -> None:
    hits = episode(["sleep 30", "sleep 30", "true"], timeout=1)
    assert names(hits) == ["time"], hits
    assert hits[0].count == 2


def test_the_words_of_a_full_disk_alone_are_not_a_limit(episode: Episode) -> None:
    hits = episode(["echo 'No space left on device' >&2; exit 1"], disk_bytes=8 * MiB)
    assert hits == []
