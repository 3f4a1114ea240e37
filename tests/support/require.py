"""Skips that must not happen where a component is required.

Tests that need bubblewrap, vLLM, Slurm, a browser, network namespaces or the harness
environment skip, saying why, where those are missing: a developer's machine runs the rest.
Where they must run (CI: `.ci/run`), `ROLLSERVE_TEST_REQUIRE` names them (comma-separated,
from `COMPONENTS`), and such a skip becomes a failure that says what is missing.

A test needs a component when it carries its marker (`vllm`, `slurm`, `browser`, `netns`) or
when its skip reason names it (bubblewrap, the harness environment). The root conftest.py
loads this as a plugin.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

REQUIRE_ENV = "ROLLSERVE_TEST_REQUIRE"
MARKED = ("vllm", "slurm", "browser", "netns")
"""Components whose tests carry a marker of that name."""
NAMED: dict[str, tuple[str, ...]] = {
    "bwrap": ("bubblewrap", "bwrap"),
    "harness": ("harness environment", "make harness-env"),
}
"""Components known by words of a skip reason."""
COMPONENTS = (*MARKED, *NAMED)


def required(value: str | None = None) -> set[str]:
    """The components `ROLLSERVE_TEST_REQUIRE` names; a usage error for an unknown one."""
    text = os.environ.get(REQUIRE_ENV, "") if value is None else value
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(COMPONENTS)
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names {', '.join(sorted(unknown))}: "
            f"the components are {', '.join(COMPONENTS)}"
        )
    return names


def needed_by(item: pytest.Item, reason: str, wanted: set[str]) -> set[str]:
    """Which of `wanted` a test that skipped with `reason` needed."""
    marked = {name for name in MARKED if name in wanted and item.get_closest_marker(name)}
    lowered = reason.lower()
    named = {
        name
        for name, words in NAMED.items()
        if name in wanted and any(word in lowered for word in words)
    }
    return marked | named


def pytest_configure(config: pytest.Config) -> None:
    required()  # an unknown name stops the run before any test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    wanted = required()
    if not wanted:
        return
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    missing = needed_by(item, reason, wanted)
    if missing:
        report.outcome = "failed"
        report.longrepr = (
            f"{REQUIRE_ENV} requires {', '.join(sorted(missing))} here, "
            f"but the test skipped: {reason}"
        )
