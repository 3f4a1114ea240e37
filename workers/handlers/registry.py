"""Which handler serves which `data_source`: the built-ins and plugins.

Plugins register a `Handler` subclass under the entry-point group `rollserve.handlers`
(`name = "package.module:Class"`); the entry point's name is the `data_source` it serves.
A plugin that fails to load is logged and skipped. A plugin cannot replace a built-in.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points

from workers.handlers.base import Handler
from workers.handlers.code.handler import CodeHandler
from workers.handlers.math import MathHandler
from workers.handlers.shell import ShellHandler
from workers.handlers.stem import StemHandler
from workers.handlers.swe.handler import SweHandler

ENTRY_POINT_GROUP = "rollserve.handlers"
BUILTIN_HANDLERS: dict[str, type[Handler]] = {
    CodeHandler.name: CodeHandler,
    MathHandler.name: MathHandler,
    ShellHandler.name: ShellHandler,
    StemHandler.name: StemHandler,
    SweHandler.name: SweHandler,
}

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_classes: dict[str, type[Handler]] | None = None
_instances: dict[str, Handler] = {}


class UnknownDataSource(KeyError):
    """No handler serves this `data_source`; the message lists the known names."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown data_source {self.name!r}; known: {', '.join(self.known)}"


def _discover() -> dict[str, type[Handler]]:
    """The built-in handler classes plus every plugin that loads and is a `Handler`."""
    classes = dict(BUILTIN_HANDLERS)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
        except Exception:
            logger.exception(
                "handler plugin %r (%s) failed to load; skipped", entry.name, entry.value
            )
            continue
        if not (isinstance(loaded, type) and issubclass(loaded, Handler)):
            logger.error(
                "handler plugin %r (%s) is not a Handler subclass; skipped", entry.name, entry.value
            )
            continue
        known = classes.get(entry.name)
        if known is loaded:
            continue
        if known is not None:
            logger.warning(
                "handler plugin %r (%s) clashes with an existing handler; skipped",
                entry.name,
                entry.value,
            )
            continue
        classes[entry.name] = loaded
    return classes


def _handler_classes() -> dict[str, type[Handler]]:
    global _classes
    with _lock:
        if _classes is None:
            _classes = _discover()
        return _classes


def known_handlers() -> list[str]:
    """The names of every available handler, sorted."""
    return sorted(_handler_classes())


def get_handler(name: str) -> Handler:
    """The shared handler instance for `data_source` `name`.

    Raises `UnknownDataSource` (a KeyError) listing the known names when there is none.
    """
    classes = _handler_classes()
    with _lock:
        handler = _instances.get(name)
        if handler is None:
            if name not in classes:
                raise UnknownDataSource(name, sorted(classes))
            handler = _instances[name] = classes[name]()
        return handler


def reload_handlers() -> None:
    """Forget discovered handlers and their instances; the next lookup discovers again."""
    global _classes
    with _lock:
        _classes = None
        _instances.clear()
