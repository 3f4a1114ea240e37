"""Tests marked `vllm` need the CPU build of vLLM that `make vllm` installs (`make test` tries
to, while the suite runs: those tests wait for that install, `ROLLSERVE_VLLM_INSTALLING`).
Where it is not installed, or its install failed, every such test skips with the reason
`deploy.vllm_env.find_vllm` gives (never silently).

The root conftest.py loads this as a plugin.

- `vllm_install`: the usable vLLM virtualenv (`VllmStatus`: `executable`, `python`, `venv`).
"""

from __future__ import annotations

import os

import pytest

from deploy.vllm_env import INSTALLING_ENV, VllmStatus, find_vllm, installing, wait_installed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not marked:
        return
    status = find_vllm()
    if status.usable or os.environ.get(INSTALLING_ENV) or installing(status.venv):
        return  # an install runs beside this session: `vllm_install` waits for it
    skip = pytest.mark.skip(reason=status.reason)
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_install() -> VllmStatus:
    """The vLLM virtualenv `make vllm` built (once an install running beside this session
    ends); skips the test, saying why, without one."""
    status = wait_installed()
    if not status.usable:
        pytest.skip(status.reason)
    return status
