"""Choosing where boxes live: by name, or the best this host offers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

from sandbox.apptainer import ApptainerBackend
from sandbox.base import (
    ALLOW_LOCAL_ENV,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    env_flag,
)
from sandbox.bwrap import BubblewrapBackend
from sandbox.local import LocalBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[SandboxBackend]] = {
    "apptainer": ApptainerBackend,
    "bwrap": BubblewrapBackend,
    "local": LocalBackend,
}
"""Every backend by name; `auto` tries them in this order (`local` only when allowed)."""


def get_backend(name: str = "auto") -> SandboxBackend:
    """The backend called `name`, with its default options.

    `auto` picks the first that works here, in the order apptainer, bwrap, and logs why each
    one before it was passed over; where none works it falls back to `local` (no isolation)
    only when `ROLLSERVE_SANDBOX_ALLOW_LOCAL` is set, and otherwise returns a backend whose
    `create` raises SandboxError saying why each one was passed over. A named backend is
    returned even if it does not work here: its `create` then raises SandboxError saying why.
    An unknown name raises ValueError listing the names.
    """
    if name == "auto":
        passed_over = []
        for candidate, backend_class in BACKENDS.items():
            if candidate == "local":
                continue
            backend = backend_class()
            ok, why = backend.available()
            if ok:
                log.info("sandbox backend: %s", candidate)
                return backend
            log.info("sandbox backend %s passed over: %s", candidate, why)
            passed_over.append(f"{candidate}: {why}")
        if env_flag(ALLOW_LOCAL_ENV):
            log.warning("sandbox backend: local (NO ISOLATION), as %s allows", ALLOW_LOCAL_ENV)
            return LocalBackend()
        return NoBackend(
            "no sandbox backend that isolates boxes works here ("
            + "; ".join(passed_over)
            + f"), and {ALLOW_LOCAL_ENV} is not set to allow `local` (no isolation)"
        )
    if name not in BACKENDS:
        names = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown sandbox backend {name!r}: choose one of {names}")
    return BACKENDS[name]()


class NoBackend(SandboxBackend):
    """What `auto` gives where no isolating backend works and `local` is not allowed: it
    makes no box, saying why."""

    name: ClassVar[str] = "none"

    def __init__(self, why: str) -> None:
        self.why = why

    def available(self) -> tuple[bool, str]:
        return False, self.why

    def create(self, spec: SandboxSpec, state_root: Path) -> Sandbox:
        raise SandboxError(self.why)


def backend_class(name: str) -> type[SandboxBackend]:
    """The class of the backend called `name` (SandboxBackend itself for an unknown one),
    for killing what a sandbox of that backend left behind."""
    return BACKENDS.get(name, SandboxBackend)
