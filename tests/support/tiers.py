"""How the suite is divided: two tiers, and groups of tests for pytest-xdist's workers.

Tiers. A test marked `full` (or needing a component of its own: `vllm`, `slurm`, `browser`,
`netns`) is in the full tier; every other test is in the check tier, which `make check` runs
alone (`-m "not full"`): real Redis, the real gateway, real bubblewrap boxes with the real tool
server, and one whole-pipeline stack. `make test` runs both and ends with the time of each.

Groups. `make test` spreads the suite over pytest-xdist workers; a group is run by one worker
from start to end, so that what its tests share is made once: every module is a group of its
own (its module-scoped stack starts once), or each of its stack variants is (`run=<pool>`),
and tests/vllm/ is one group (its tests share one
session-scoped vLLM server and one package-scoped stack). The full tier is collected first,
vLLM first, and handed out in that order (`--no-loadscope-reorder`), so that no worker is
given a long group when the others are nearly done.

The root conftest.py loads this as a plugin; without xdist the groups are inert.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

SHARED_DIRECTORIES = ("tests/vllm/",)
"""Directories whose tests share session-scoped services: each is one group."""
VARIANT = re.compile(r"(?<=[\[-])run=\w+(?=[\]-])")
"""A module-scoped stack variant in a test's id (`test_x[run=jobs]`)."""
FULL_MARKERS = ("full", "vllm", "slurm", "browser", "netns")
"""A test with one of these is in the full tier."""


def tier_of(item: pytest.Item) -> str:
    return "full" if any(item.get_closest_marker(m) for m in FULL_MARKERS) else "check"


def group_of(nodeid: str) -> str:
    """The group of a test, from its node id (all the xdist controller knows of it): a
    module, or a module's stack variant (a test id holding `run=<pool>`, see
    tests/e2e/conftest.py: each variant has a stack of its own, so two workers may take them)."""
    for directory in SHARED_DIRECTORIES:
        if nodeid.startswith(directory):
            return directory.rstrip("/")
    module = nodeid.split("::", 1)[0]
    variant = VARIANT.search(nodeid.split("::", 1)[-1])
    return f"{module}[{variant[0]}]" if variant else module


def rank_of(item: pytest.Item) -> int:
    """Collection rank: shared services first, then the rest of the full tier, then check."""
    if group_of(item.nodeid).startswith(SHARED_DIRECTORIES):
        return 0
    return 1 if tier_of(item) == "full" else 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if tier_of(item) == "full" and item.get_closest_marker("full") is None:
            item.add_marker(pytest.mark.full)
    # A stable sort: within a rank, the collection order (module by module) stays.
    items.sort(key=rank_of)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, with `group_of` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


CPU_START = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[CPU_START] = cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # On the teardown report (made in the worker, read by the controller): the test's CPU
    # seconds from its setup on, its module-scoped fixtures' teardown included.
    if call.when == "teardown" and CPU_START in item.stash:
        item.user_properties.append(("cpu_seconds", cpu_seconds() - item.stash[CPU_START]))
    return (yield)


class TierClock:
    """Per tier: seconds of test time (setup, call and teardown) and of CPU (the test process
    and the processes it started and waited for); the modules that cost the most CPU; the
    groups that take the longest; the session's wall time."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.seconds: dict[str, float] = {"check": 0.0, "full": 0.0}
        self.cpu: dict[str, float] = {"check": 0.0, "full": 0.0}
        self.module_cpu: dict[str, float] = {}
        self.group_seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {"check": set(), "full": set()}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = "full" if "full" in report.keywords else "check"
        self.seconds[tier] += report.duration
        self.tests[tier].add(report.nodeid)
        group = group_of(report.nodeid)
        self.group_seconds[group] = self.group_seconds.get(group, 0.0) + report.duration
        for name, value in report.user_properties:
            if name == "cpu_seconds" and isinstance(value, float):
                self.cpu[tier] += value
                module = report.nodeid.split("::", 1)[0]
                self.module_cpu[module] = self.module_cpu.get(module, 0.0) + value

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not any(self.tests.values()):
            return
        wall = time.monotonic() - self.began
        write = terminalreporter.write_line
        terminalreporter.section("the modules that cost the most CPU")
        costly = sorted(self.module_cpu.items(), key=lambda kv: -kv[1])[:15]
        for module, seconds in costly:
            write(f"{seconds:8.1f}s CPU  {module}")
        terminalreporter.section("the groups that take the longest (one worker each)")
        longest = sorted(self.group_seconds.items(), key=lambda kv: -kv[1])[:25]
        for group, seconds in longest:
            write(f"{seconds:8.1f}s  {group}")
        terminalreporter.section("time of each tier")
        for tier in ("check", "full"):
            count = len(self.tests[tier])
            if count:
                write(
                    f"{tier:>5}: {count} tests, {self.seconds[tier] / 60:.1f} min of test time, "
                    f"{self.cpu[tier] / 60:.1f} min of CPU"
                )
        write(f"session: {wall / 60:.1f} min of wall time")


def pytest_configure(config: pytest.Config) -> None:
    # In the process that reports (the only one without xdist; the controller with it).
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(TierClock(), "rollserve-tier-clock")
