"""Grading boxes: a fresh sandbox for one grade, labelled with the job it grades, always stopped.

Handlers that grade outside the job's own sandbox (`code`, `swe`) run the answer in a box of
its own: made under the grading root of the host's sandbox dir (`<sandbox_dir>/.grading`,
`sandbox.reaper.GRADING_DIR`), started without a tool server, and stopped when the grade is
done, whatever happened. Its spec carries the job's id, so a box a crashed grader left behind
is taken by the workers' one reaper, like the boxes jobs hold: once the job is over, its
lease ran out, or the box is gone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core.settings import Settings
from sandbox.backends import get_backend
from sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from sandbox.reaper import GRADING_DIR


@dataclass(frozen=True)
class GradingPlace:
    """Where grading boxes are made: a sandbox backend's name and a state root."""

    backend: str
    state_root: Path


def grading_place(
    settings: Settings, *, backend: str | None = None, state_root: Path | None = None
) -> GradingPlace:
    """`backend` and `state_root`, by default the settings' sandbox backend and the grading
    root of their sandbox dir (which the workers' reaper sweeps)."""
    return GradingPlace(
        backend=backend or settings.sandbox_backend,
        state_root=state_root or settings.sandbox_dir.resolve() / GRADING_DIR,
    )


@functools.cache
def _backend(name: str) -> SandboxBackend:
    """One backend object per name, so `auto` probes this host once, not once per grade."""
    return get_backend(name)


@contextlib.contextmanager
def grading_box(
    spec: SandboxSpec,
    place: GradingPlace,
    *,
    setup: Callable[[Sandbox], None] | None = None,
    start_timeout: float = 30.0,
) -> Iterator[Sandbox]:
    """A fresh box made from `spec` (whose `job_id` is the job being graded) under `place`,
    given to `setup` before it starts (to fill its workspace), then started without a tool
    server; stopped when the block ends, however it ends."""
    box = _backend(place.backend).create(spec, place.state_root)
    try:
        if setup is not None:
            setup(box)
        box.start(tool_server=False, timeout=start_timeout)
        yield box
    finally:
        box.stop()
