"""Fixtures of the routing tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


@pytest.fixture(scope="module")
def model_server(devservers: dict[str, DevBackend]) -> DevBackend:
    """The development server running the tiny model itself."""
    return devservers["model"]
