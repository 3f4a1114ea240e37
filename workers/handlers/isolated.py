"""Isolated grading: the check runs in a box the agent never touched.

A sandboxed task may ask for it with `"grading": {"isolated": true, "files": {...}}`. The
agent's box is then only read: its final `/workspace` is copied (as a tar, through a fresh
process over the halted box) into a fresh box made like the task's (its root, its limits),
with no network; the task's grading files (`grading.files`, paths under `/workspace`) are
written there only then, over whatever the agent left at those paths, so the agent never saw
them; and the check runs there (`check_command`). Nothing of the agent's box takes part but
its files: not its `/tmp`, not its home, not its processes.

`swe` tasks are always graded so (a fresh box from the task's image, the patch applied, the
test patch brought in at grading time); `code` programs too. `shell` tasks choose it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

from sandbox.base import SandboxSpec
from workers.handlers.base import Grade, TaskValidationError, ToolSession
from workers.handlers.gradingbox import GradingPlace, check_command, grading_box

MAX_COPY_BYTES = 6 << 20
"""Largest workspace (as a tar) copied into the isolated box; a larger one scores 0."""
COPY_TIMEOUT = 120.0


class WorkspaceNotCopied(ValueError):
    """The agent's workspace cannot be copied into the isolated box (too large, unreadable):
    the grade is 0, saying why."""


@dataclasses.dataclass(frozen=True)
class IsolatedGrading:
    """A task's `grading` object: whether to grade in a fresh box, and the files brought in."""

    isolated: bool = False
    files: dict[str, str] = dataclasses.field(default_factory=dict)


def read_grading(task: dict[str, Any], files_of: Any) -> IsolatedGrading:
    """The task's `grading` (`{"isolated": bool, "files": {path: text}}`), checked;
    `files_of(mapping, field)` checks the paths (as the task's own `files`)."""
    raw = task.get("grading")
    if raw is None:
        return IsolatedGrading()
    if not isinstance(raw, dict):
        raise TaskValidationError("grading", 'must be an object: {"isolated": true, ...}')
    unknown = set(raw) - {"isolated", "files"}
    if unknown:
        raise TaskValidationError(f"grading.{sorted(unknown)[0]}", "is not a grading option")
    isolated = raw.get("isolated", False)
    if not isinstance(isolated, bool):
        raise TaskValidationError("grading.isolated", "must be true or false")
    files = files_of(raw.get("files"), "grading.files")
    if files and not isolated:
        raise TaskValidationError("grading.files", 'needs "isolated": true')
    return IsolatedGrading(isolated=isolated, files=files)


def copy_out_workspace(tools: ToolSession) -> bytes:
    """The agent's /workspace as a tar, read by a fresh process over its halted box;
    `WorkspaceNotCopied` when it cannot be read or is larger than `MAX_COPY_BYTES`."""
    result = tools.call(
        "bash",
        command=(f"tar -C /workspace -cf - . | head -c {MAX_COPY_BYTES + 1} | base64 -w0"),
        timeout=COPY_TIMEOUT,
    )
    try:
        data = base64.b64decode("".join(str(result.get("output", "")).split()), validate=True)
    except binascii.Error:
        raise WorkspaceNotCopied("the workspace could not be read for isolated grading") from None
    if result.get("exit_code") != 0 or not data:
        raise WorkspaceNotCopied("the workspace could not be read for isolated grading")
    if len(data) > MAX_COPY_BYTES:
        raise WorkspaceNotCopied(
            f"the workspace is larger than {MAX_COPY_BYTES >> 20} MiB as a tar: "
            "too large to copy for isolated grading"
        )
    return data


_WRITE = 'rm -rf -- "$1" && mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'


def grade_isolated(
    spec: SandboxSpec,
    place: GradingPlace,
    workspace: bytes,
    grading: IsolatedGrading,
    check: str,
    timeout: float,
) -> Grade:
    """Run `check` in a fresh box made from `spec` (without network) holding `workspace`
    (a tar) and then `grading.files`; reward 1.0 when it exits 0."""
    spec = dataclasses.replace(spec, network=False, egress=[])
    with grading_box(spec, place) as box:
        unpacked = box.exec(["tar", "-C", "/workspace", "-xf", "-"], input=workspace,
                            timeout=COPY_TIMEOUT)  # fmt: skip
        if unpacked.returncode != 0:
            why = unpacked.stderr[-500:]
            raise WorkspaceNotCopied(f"the workspace could not be unpacked: {why}")
        for path, text in grading.files.items():
            written = box.exec(["bash", "-c", _WRITE, "write", path],
                               input=text.encode("utf-8"), timeout=COPY_TIMEOUT)  # fmt: skip
            if written.returncode != 0:
                why = written.stderr[-500:]
                raise WorkspaceNotCopied(f"cannot write {path} for grading: {why}")
        result = box.exec(["bash", "-c", check_command(check)], timeout=timeout)
    passed = result.returncode == 0 and not result.timed_out
    return Grade(
        reward=1.0 if passed else 0.0,
        details={
            "check": check,
            "isolated": True,
            "exit_code": None if result.timed_out else result.returncode,
            "timed_out": result.timed_out,
            "output": (result.stdout + result.stderr)[-2000:],
        },
    )
