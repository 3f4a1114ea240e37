"""A task's `sandbox.limits`: checked at submission (typed, at least a floor, at most the
service's own limit, naming the field) and carried into the sandbox spec's box-wide limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from api.service import RequestError, validate_task
from core.schemas import Task
from core.settings import Settings, get_settings
from workers.handlers.base import TaskValidationError
from workers.handlers.boxlimits import task_limits
from workers.handlers.shell import ShellHandler
from workers.handlers.swe.handler import SweHandler

SHELL = {"data_source": "shell", "instruction": "do it", "check": "true"}
SETTINGS = Settings(
    sandbox_memory_mb=1024, sandbox_pids=256, sandbox_disk_mb=512, sandbox_inodes=50_000,
    sandbox_cpu_shares=512,
)  # fmt: skip


def with_limits(**limits: Any) -> dict[str, Any]:
    return {**SHELL, "sandbox": {"limits": limits}}


def test_without_limits_a_box_gets_the_services_own() -> None:
    assert task_limits(SHELL, SETTINGS) == {
        "memory_mb": 1024, "pids": 256, "disk_mb": 512, "inodes": 50_000,
    }  # fmt: skip
    limits = ShellHandler(settings=SETTINGS).sandbox_spec(SHELL, "job-1").limits
    assert limits.box_memory_bytes == 1024 << 20
    assert limits.box_pids == 256
    assert limits.disk_bytes == 512 << 20
    assert limits.disk_inodes == 50_000
    assert limits.box_cpu_shares == 512


def test_a_task_may_ask_for_less_and_its_box_gets_it() -> None:
    task = with_limits(memory_mb=256, pids=64, disk_mb=128, inodes=1000)
    handler = ShellHandler(settings=SETTINGS)
    handler.validate(task)
    limits = handler.sandbox_spec(task, "job-1").limits
    assert (limits.box_memory_bytes, limits.box_pids) == (256 << 20, 64)
    assert (limits.disk_bytes, limits.disk_inodes) == (128 << 20, 1000)
    assert limits.memory_bytes is not None  # the per-process rlimits stay


def test_a_smaller_memory_brings_the_disk_down_with_it_unless_the_task_sets_the_disk() -> None:
    assert task_limits(with_limits(memory_mb=100), SETTINGS)["disk_mb"] == 100
    assert task_limits(with_limits(memory_mb=100, disk_mb=300), SETTINGS)["disk_mb"] == 300


@pytest.mark.parametrize(
    ("limits", "field", "words"),
    [
        ({"memory_mb": 2048}, "sandbox.limits.memory_mb", "at most 1024"),
        ({"pids": 257}, "sandbox.limits.pids", "ROLLSERVE_SANDBOX_PIDS"),
        ({"disk_mb": 513}, "sandbox.limits.disk_mb", "at most 512"),
        ({"inodes": 10**9}, "sandbox.limits.inodes", "at most 50000"),
        ({"memory_mb": 0}, "sandbox.limits.memory_mb", "at least 32"),
        ({"pids": -1}, "sandbox.limits.pids", "at least"),
        ({"memory_mb": "512"}, "sandbox.limits.memory_mb", "whole number"),
        ({"memory_mb": 512.0}, "sandbox.limits.memory_mb", "whole number"),
        ({"pids": True}, "sandbox.limits.pids", "whole number"),
        ({"cpus": 2}, "sandbox.limits.cpus", "not a sandbox limit"),
    ],
)
def test_a_limit_over_the_cap_or_of_the_wrong_kind_is_refused_naming_it(
    limits: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(TaskValidationError, match=words) as caught:
        ShellHandler(settings=SETTINGS).validate(with_limits(**limits))
    assert caught.value.field == field


def test_swe_tasks_are_checked_the_same_way() -> None:
    task = {
        "data_source": "swe", "instance_id": "x__y-1", "repo": "x/y", "base_commit": "abcdef1",
        "problem_statement": "fix it", "test_patch": "", "FAIL_TO_PASS": ["t::a"],
        "PASS_TO_PASS": [], "environment": {"image": "docker://python:3.11"},
    }  # fmt: skip
    SweHandler(settings=SETTINGS).validate(task)
    with pytest.raises(TaskValidationError) as caught:
        SweHandler(settings=SETTINGS).validate({**task, "sandbox": {"limits": {"pids": 9999}}})
    assert caught.value.field == "sandbox.limits.pids"


@pytest.mark.parametrize(
    ("sandbox", "field"), [("big", "sandbox"), ({"limits": [1]}, "sandbox.limits")]
)
def test_a_sandbox_entry_that_is_not_an_object_is_refused(sandbox: Any, field: str) -> None:
    with pytest.raises(TaskValidationError) as caught:
        ShellHandler(settings=SETTINGS).validate({**SHELL, "sandbox": sandbox})
    assert caught.value.field == field


def test_a_cap_lowered_after_submission_fails_the_sandbox_spec() -> None:
    task = with_limits(memory_mb=1000)
    ShellHandler(settings=SETTINGS).validate(task)
    lower = SETTINGS.model_copy(update={"sandbox_memory_mb": 512})
    with pytest.raises(TaskValidationError, match="at most 512"):
        ShellHandler(settings=lower).sandbox_spec(task, "job-1")


@pytest.fixture
def process_memory_cap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's settings (what the gateway's handlers read) with a 1024 MiB cap."""
    monkeypatch.setenv("ROLLSERVE_SANDBOX_MEMORY_MB", "1024")
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("ROLLSERVE_SANDBOX_MEMORY_MB")
    get_settings.cache_clear()


@pytest.mark.usefixtures("process_memory_cap")
def test_submission_refuses_a_limit_over_the_cap_with_a_422_at_the_field() -> None:
    validate_task(Task(**with_limits(memory_mb=512)), ["body", "task"])
    with pytest.raises(RequestError) as caught:
        validate_task(Task(**with_limits(memory_mb=4096)), ["body", "task"])
    assert caught.value.status_code == 422
    assert caught.value.loc == ["body", "task", "sandbox", "limits", "memory_mb"]
    assert "at most 1024" in caught.value.message
