"""Finding the processes a test left running."""

from __future__ import annotations

from pathlib import Path


def processes_mentioning(needle: str) -> list[int]:
    """Pids whose command line or environment mentions `needle`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            blob = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if needle.encode() in blob:
            found.append(int(proc.name))
    return found
