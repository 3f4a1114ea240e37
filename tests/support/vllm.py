"""Tests marked `vllm` need the CPU build of vLLM that `make vllm` installs (`make test` tries
to). Where it is not installed, or its install failed, every such test skips with the reason
`deploy.vllm_env.find_vllm` gives (never silently).

The root conftest.py loads this as a plugin.

- `vllm_install`: the usable vLLM virtualenv (`VllmStatus`: `executable`, `python`, `venv`).
"""

from __future__ import annotations

import pytest

from deploy.vllm_env import VllmStatus, find_vllm


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not marked:
        return
    status = find_vllm()
    if status.usable:
        return
    skip = pytest.mark.skip(reason=status.reason)
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_install() -> VllmStatus:
    """The vLLM virtualenv `make vllm` built; skips the test, saying why, without one."""
    status = find_vllm()
    if not status.usable:
        pytest.skip(status.reason)
    return status
