"""Sandboxes for agents' tools: one interface, several backends, and a reaper for orphans."""

from sandbox.backends import BACKENDS, get_backend
from sandbox.base import (
    Bind,
    ExecResult,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
)
from sandbox.reaper import list_sandboxes, reap

__all__ = [
    "BACKENDS",
    "Bind",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxInfo",
    "SandboxSpec",
    "get_backend",
    "list_sandboxes",
    "reap",
]
