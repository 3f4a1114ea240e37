"""A shell task's `egress`: checked at submission against the operator's cap, naming the field,
and carried into the sandbox spec."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from api.service import RequestError, validate_task
from core.schemas import Task
from core.settings import Settings, get_settings
from workers.handlers.base import TaskValidationError
from workers.handlers.shell import ShellHandler

SHELL = {"data_source": "shell", "instruction": "fetch it", "check": "true", "network": True}
CAP = "pypi.org,*.pythonhosted.org,registry.npmjs.org:443"


def handler(cap: str | None = CAP) -> ShellHandler:
    return ShellHandler(settings=Settings(sandbox_egress_allow=cap))


def test_hosts_within_the_cap_pass_and_reach_the_sandbox_spec() -> None:
    task = {**SHELL, "egress": ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org:443"]}
    handler().validate(task)
    spec = handler().sandbox_spec(task, "job-1")
    assert spec.network is True
    assert spec.egress == ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org:443"]


def test_a_network_task_without_egress_gets_a_box_that_reaches_no_host() -> None:
    handler(None).validate(SHELL)
    spec = handler(None).sandbox_spec(SHELL, "job-1")
    assert spec.network is True and spec.egress == []


@pytest.mark.parametrize(
    ("egress", "cap", "words"),
    [
        (["github.com"], CAP, "github.com: not among the hosts"),
        (["pypi.org"], None, "pypi.org: not among the hosts"),
        (["registry.npmjs.org"], CAP, "registry.npmjs.org: not among"),  # 80 is not allowed
        (["pythonhosted.org"], CAP, "pythonhosted.org: not among"),
        (["pypi.org:22"], CAP, "pypi.org:22: not among"),
        (["*.pythonhosted.org"], CAP, "is not a host name"),
        (["203.0.113.80"], CAP, "is not a host name"),
        ("pypi.org", CAP, "must be a list"),
        ([443], CAP, "is not a host name"),
    ],
)
def test_a_host_outside_the_cap_or_not_a_host_is_refused_naming_egress(
    egress: Any, cap: str | None, words: str
) -> None:
    with pytest.raises(TaskValidationError, match=words) as caught:
        handler(cap).validate({**SHELL, "egress": egress})
    assert caught.value.field == "egress"


def test_egress_needs_network_on() -> None:
    task = {**SHELL, "network": False, "egress": ["pypi.org"]}
    with pytest.raises(TaskValidationError, match='needs "network": true'):
        handler().validate(task)


def test_a_cap_narrowed_after_submission_fails_the_sandbox_spec() -> None:
    task = {**SHELL, "egress": ["pypi.org"]}
    handler().validate(task)
    with pytest.raises(TaskValidationError, match=r"pypi\.org: not among"):
        handler("files.pythonhosted.org").sandbox_spec(task, "job-1")


@pytest.fixture
def process_cap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's settings (what the gateway's handlers read) with `CAP` as the cap."""
    monkeypatch.setenv("ROLLSERVE_SANDBOX_EGRESS_ALLOW", CAP)
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("ROLLSERVE_SANDBOX_EGRESS_ALLOW")
    get_settings.cache_clear()


@pytest.mark.usefixtures("process_cap")
def test_submission_refuses_a_host_outside_the_cap_with_a_422_at_the_field() -> None:
    validate_task(Task.model_validate({**SHELL, "egress": ["pypi.org"]}), ["body", "task"])
    with pytest.raises(RequestError) as caught:
        validate_task(Task.model_validate({**SHELL, "egress": ["github.com"]}), ["body", "task"])
    assert caught.value.status_code == 422
    assert caught.value.loc == ["body", "task", "egress"]
    assert "github.com" in caught.value.message
