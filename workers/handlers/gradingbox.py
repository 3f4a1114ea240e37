"""Grading boxes: a fresh sandbox for one grade, labelled with the job it grades, always
stopped; and the environment a check command runs in (`check_command`).

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
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core.settings import Settings
from sandbox.backends import get_backend
from sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from sandbox.reaper import GRADING_DIR

GIT_RUNS_NOTHING: dict[str, str] = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}
"""Git as a grader runs it: no system configuration, no hook, no fsmonitor, whatever a
repository's own configuration says (these outrank it, as `git -c` does)."""

CHECK_ENV: dict[str, str] = {
    **GIT_RUNS_NOTHING,
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "PYTHONSAFEPATH": "1",
    "PYTHONNOUSERSITE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
"""What a check command's environment adds to the box's: Python puts neither the current
directory nor a script's on `sys.path` (a `json.py` left in /workspace is not the standard
library's) and reads no user site (its `.pth` and `usercustomize`); git reads no global or
system configuration and runs no hook or fsmonitor."""

CHECK_UNSET = (
    "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONINSPECT",
    "BASH_ENV", "ENV", "CDPATH", "GLOBIGNORE", "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "LD_PRELOAD", "LD_LIBRARY_PATH",
)  # fmt: skip
"""Variables a check runs without, whatever the box's environment holds."""

_EXPORTS = " ".join(f"{name}={shlex.quote(value)}" for name, value in CHECK_ENV.items())
_CHECK_WRAPPER = f"""\
home="$(mktemp -d "${{TMPDIR:-/tmp}}/check.XXXXXXXX")" || exit 125
mkdir -m 700 "$home/home" "$home/tmp" || exit 125
export HOME="$home/home" TMPDIR="$home/tmp" {_EXPORTS}
unset {" ".join(CHECK_UNSET)}
cd /workspace || exit 125
exec bash --noprofile --norc -c "$1"
"""


def check_command(check: str) -> str:
    """Bash running `check` as a grader should (`bash --noprofile --norc`, from
    /workspace): with a home and a temporary directory (`HOME`, `TMPDIR`) made for it,
    `CHECK_ENV` added and `CHECK_UNSET` removed. Exit status 125 when that cannot be made.

    The fixed path `/tmp` stays the box's: fresh processes of a box with a disk of its own
    share it with the agent's (`sandbox.boxdisk`), so a check finds there what the agent
    left and should make its own files with `mktemp` or under `$TMPDIR`."""
    return (
        f"exec bash --noprofile --norc -c {shlex.quote(_CHECK_WRAPPER)} check {shlex.quote(check)}"
    )


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
