"""The box-wide limits of a task's sandbox: the service's own (`ROLLSERVE_SANDBOX_MEMORY_MB`,
`_PIDS`, `_DISK_MB`, `_INODES`, `_CPU_SHARES`), lowered where the task asks for less:

    {"sandbox": {"limits": {"memory_mb": 1024, "pids": 128, "disk_mb": 512, "inodes": 20000}}}

Each value is a whole number between a floor a box needs to start and the service's own
value: a task can lower a limit, never raise it. A task that lowers `memory_mb` without
giving `disk_mb` gets a disk no bigger than its memory (what the box writes to its disk is
memory too, and a full disk should be ENOSPC, not an OOM kill).

Handlers that make sandboxes call `box_limits` in `validate`, so a bad value is refused at
submission naming its field, and in `sandbox_spec`, where the worker's settings apply (an
operator may have lowered them since).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.settings import Settings
from sandbox.base import Limits
from workers.handlers.base import TaskValidationError

TASK_LIMITS: dict[str, tuple[str, int]] = {
    "memory_mb": ("sandbox_memory_mb", 32),
    "pids": ("sandbox_pids", 16),
    "disk_mb": ("sandbox_disk_mb", 1),
    "inodes": ("sandbox_inodes", 64),
}
"""What a task may set under `sandbox.limits`: the setting that caps it, and its floor."""


def task_limits(task: dict[str, Any], settings: Settings) -> dict[str, int]:
    """The four limits of `task`'s box (`TASK_LIMITS`): the task's own where it gives one,
    else the settings'. A `TaskValidationError` names the field (`sandbox.limits.memory_mb`)
    of a value that is not a whole number, below its floor or above the settings' cap."""
    sandbox = task.get("sandbox")
    requested: Any = {}
    if sandbox is not None:
        if not isinstance(sandbox, dict):
            raise TaskValidationError("sandbox", "must be an object (with `limits`)")
        requested = sandbox.get("limits")
        if requested is None:
            requested = {}
        elif not isinstance(requested, dict):
            raise TaskValidationError(
                "sandbox.limits", f"must map limit names ({', '.join(TASK_LIMITS)}) to numbers"
            )
    for key in requested:
        if key not in TASK_LIMITS:
            raise TaskValidationError(
                f"sandbox.limits.{key}", f"is not a sandbox limit; known: {', '.join(TASK_LIMITS)}"
            )
    values: dict[str, int] = {}
    for key, (setting, floor) in TASK_LIMITS.items():
        cap = int(getattr(settings, setting))
        value = requested.get(key)
        where = f"sandbox.limits.{key}"
        if value is None:
            values[key] = cap
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TaskValidationError(where, "must be a whole number")
        if value < floor:
            raise TaskValidationError(where, f"must be at least {floor}")
        if value > cap:
            raise TaskValidationError(
                where,
                f"must be at most {cap}, this service's limit (ROLLSERVE_{setting.upper()})",
            )
        values[key] = value
    if requested.get("disk_mb") is None:
        values["disk_mb"] = min(values["disk_mb"], values["memory_mb"])
    return values


def box_limits(task: dict[str, Any], settings: Settings, base: Limits | None = None) -> Limits:
    """`base` (the default limits when None) with the box-wide limits of `task`'s box
    (`task_limits`) and the settings' CPU share."""
    values = task_limits(task, settings)
    return dataclasses.replace(
        base or Limits(),
        box_memory_bytes=values["memory_mb"] << 20,
        box_pids=values["pids"],
        box_cpu_shares=settings.sandbox_cpu_shares,
        disk_bytes=values["disk_mb"] << 20,
        disk_inodes=values["inodes"],
    )
