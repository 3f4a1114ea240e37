"""The handler registry: built-ins, cached instances, and plugins from entry points."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.handlers.math import MathHandler
from workers.handlers.registry import (
    UnknownDataSource,
    get_handler,
    known_handlers,
    reload_handlers,
)
from workers.handlers.stem import StemHandler

PLUGIN_MODULE = """
from typing import Any

from workers.handlers.base import Grade, Handler, StepResult


class EchoHandler(Handler):
    name = "echo"

    def validate(self, task: dict[str, Any]) -> None:
        pass

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["text"]}]

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        return StepResult(done=True, messages=[], stop_reason="answer")

    def grade(self, task: dict[str, Any], assistant_texts: list[str]) -> Grade:
        return Grade(reward=1.0, details={})


class NotAHandler:
    pass
"""


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    reload_handlers()
    yield
    reload_handlers()


def install_plugin(directory: Path, entry_points: str) -> None:
    """A distribution on `directory` (put on sys.path by the caller) with these entry points."""
    (directory / "echo_plugin.py").write_text(PLUGIN_MODULE)
    dist_info = directory / "echo_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[rollserve.handlers]\n" + textwrap.dedent(entry_points)
    )
    importlib.invalidate_caches()


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("echo_plugin", None)


def test_built_in_handlers_are_known_in_sorted_order() -> None:
    names = known_handlers()
    assert {"math", "stem"} <= set(names)
    assert names == sorted(names)


def test_get_handler_returns_the_built_in_handler_classes() -> None:
    assert isinstance(get_handler("math"), MathHandler)
    assert isinstance(get_handler("stem"), StemHandler)


def test_get_handler_returns_one_shared_instance_per_name() -> None:
    assert get_handler("math") is get_handler("math")


def test_unknown_data_source_is_a_key_error_listing_the_known_names() -> None:
    with pytest.raises(UnknownDataSource) as error:
        get_handler("chess")
    assert isinstance(error.value, KeyError)
    assert error.value.known == known_handlers()
    assert str(error.value) == f"unknown data_source 'chess'; known: {', '.join(known_handlers())}"


def test_plugin_from_an_entry_point_serves_its_name(plugin_dir: Path) -> None:
    install_plugin(plugin_dir, "echo = echo_plugin:EchoHandler\n")
    reload_handlers()
    assert "echo" in known_handlers()
    handler = get_handler("echo")
    assert handler.initial_messages({"text": "hi"}) == [{"role": "user", "content": "hi"}]


def test_plugin_that_fails_to_import_is_logged_and_skipped(
    plugin_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(
        plugin_dir,
        """
        broken = no_such_module_anywhere:Handler
        echo = echo_plugin:EchoHandler
        """,
    )
    reload_handlers()
    with caplog.at_level(logging.ERROR, logger="workers.handlers.registry"):
        names = known_handlers()
    assert "broken" not in names
    assert "echo" in names
    assert any("broken" in record.getMessage() for record in caplog.records)


def test_plugin_that_is_not_a_handler_is_skipped(
    plugin_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(plugin_dir, "odd = echo_plugin:NotAHandler\n")
    reload_handlers()
    with caplog.at_level(logging.ERROR, logger="workers.handlers.registry"):
        assert "odd" not in known_handlers()
    assert any("not a Handler" in record.getMessage() for record in caplog.records)


def test_plugin_cannot_replace_a_built_in_handler(plugin_dir: Path) -> None:
    install_plugin(plugin_dir, "math = echo_plugin:EchoHandler\n")
    reload_handlers()
    assert isinstance(get_handler("math"), MathHandler)


def test_reload_forgets_handler_instances() -> None:
    first = get_handler("stem")
    reload_handlers()
    assert get_handler("stem") is not first
