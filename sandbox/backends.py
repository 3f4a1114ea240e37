"""Choosing where boxes live: by name, or the best this host offers."""

from __future__ import annotations

import logging

from sandbox.apptainer import ApptainerBackend
from sandbox.base import SandboxBackend
from sandbox.bwrap import BubblewrapBackend
from sandbox.local import LocalBackend

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[SandboxBackend]] = {
    "apptainer": ApptainerBackend,
    "bwrap": BubblewrapBackend,
    "local": LocalBackend,
}
"""Every backend by name; `auto` tries them in this order."""


def get_backend(name: str = "auto") -> SandboxBackend:
    """The backend called `name`, with its default options.

    `auto` picks the first that works here, in the order apptainer, bwrap, local, and logs
    why each one before it was passed over. A named backend is returned even if it does not
    work here: its `create` then raises SandboxError saying why. An unknown name raises
    ValueError listing the names.
    """
    if name == "auto":
        for candidate, backend_class in BACKENDS.items():
            backend = backend_class()
            ok, why = backend.available()
            if ok:
                log.info("sandbox backend: %s", candidate)
                return backend
            log.info("sandbox backend %s passed over: %s", candidate, why)
        raise AssertionError("the local backend is always available")
    if name not in BACKENDS:
        names = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown sandbox backend {name!r}: choose one of {names}")
    return BACKENDS[name]()


def backend_class(name: str) -> type[SandboxBackend]:
    """The class of the backend called `name` (SandboxBackend itself for an unknown one),
    for killing what a sandbox of that backend left behind."""
    return BACKENDS.get(name, SandboxBackend)
