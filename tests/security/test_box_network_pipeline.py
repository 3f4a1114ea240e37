"""Boxes with network through the whole pipeline: the gateway refuses a task that asks for a
host outside the operator's cap, naming `task.egress`; a job's trajectory carries every
connection its box tried (`egress`), allowed or refused."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient, RolloutServiceError
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.sandbox import needs_box_network

pytestmark = [needs_box_network, pytest.mark.full]

ALLOWED = "pypi.org"
REFUSED = "github.com"


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FETCH = (
    f"python3 -c \"import socket; socket.getaddrinfo('{REFUSED}', 443)\"; "
    'python3 -c "import urllib.request as u; '
    f"print('status', u.urlopen('https://{ALLOWED}/simple/six/', timeout=20).status)\""
)
SCRIPT = [{"match": "FETCH", "samples": [[call("bash", command=FETCH), call("finish")]]}]


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT, "tool_timeout": 60.0, "sandbox_dir": data / "sandboxes",
        "sandbox_backend": "bwrap", "sandbox_egress_allow": f"{ALLOWED},*.pythonhosted.org",
    }  # fmt: skip


def task(**extra: object) -> dict[str, object]:
    return {
        "data_source": "shell",
        "instruction": "FETCH: fetch the index.",
        "check": "true",
        "network": True,
        **extra,
    }


def online() -> bool:
    try:
        socket.create_connection((ALLOWED, 443), timeout=5).close()
    except OSError:
        return False
    return True


def test_a_host_outside_the_cap_is_refused_at_submission_naming_the_field(
    client: RolloutClient,
) -> None:
    with pytest.raises(RolloutServiceError) as caught:
        client.submit_rollout(task(egress=[ALLOWED, REFUSED]))
    assert caught.value.status_code == 422
    [problem] = caught.value.detail
    assert problem["loc"] == ["body", "task", "egress"]
    assert REFUSED in problem["msg"]


def test_the_trajectory_records_what_the_box_reached_and_what_it_was_refused(
    client: RolloutClient, stack: Stack
) -> None:
    traj = client.submit_rollout(
        task(egress=[ALLOWED]), sampling={"seed": 0, "max_tokens": 256}, wait=True, timeout=180
    )
    assert isinstance(traj, Trajectory), traj
    assert traj.status is JobStatus.completed, traj.error
    refused = [e for e in traj.egress if e.host == REFUSED]
    assert refused and not any(e.allowed for e in refused)
    assert refused[0].kind == "dns" and refused[0].reason == "not on the allow-list"
    if online():
        output = "\n".join(t.text for t in traj.turns if t.type == "env")
        assert "status 200" in output
        assert any(e.allowed and e.host == ALLOWED and e.port == 443 for e in traj.egress)
