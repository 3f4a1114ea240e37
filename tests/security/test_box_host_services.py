"""Through the whole pipeline: a box with network reaches none of the services on its host.

The agent's command tries every service the stack started (its Redis, the gateway, the
development inference server) and the host's own Redis on port 6379 when one listens, at
every address that could lead to the host: its loopback, the user-mode network's gateway
(10.0.2.2, which slirp4netns would forward to the host's loopback), its resolver (10.0.2.3)
and the host's own address. Each try sends what the service speaks (`PING` to Redis, an
HTTP request naming `localhost` or an allowed host to the others). Reaching any of them pays
reward 1; the job must end with reward 0, and its trajectory must show the tries refused.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from api.client import RolloutClient
from core.schemas import JobStatus
from deploy.stack import Stack
from tests.support.sandbox import needs_box_network
from tests.support.wait import wait_until

pytestmark = [needs_box_network, pytest.mark.full]

ALLOWED = "pypi.org"
HOST_REDIS = 6379


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = [
    {
        "match": "PROBE",
        "samples": [[call("bash", command="python3 /workspace/probe.py"), call("finish")]],
    }
]

PROBE = """
import json, socket
REFUSALS = ("HTTP/1.1 403 Forbidden", "HTTP/1.1 502 Bad Gateway")
results = []
for address, port, payload in json.load(open("/workspace/targets.json")):
    entry = {"target": f"{address}:{port}", "read": ""}
    try:
        with socket.create_connection((address, port), timeout=5) as conn:
            conn.settimeout(5)
            conn.sendall(payload.encode())
            while len(entry["read"]) < 200:
                chunk = conn.recv(200)
                if not chunk:
                    break
                entry["read"] += chunk.decode("latin-1")
    except OSError as exc:
        entry["error"] = str(exc)
    entry["reached"] = bool(entry["read"]) and not entry["read"].startswith(REFUSALS)
    results.append(entry)
with open("/workspace/reached", "w") as out:
    out.write("".join(r["target"] + "\\n" for r in results if r["reached"]))
print("PROBED", json.dumps(results))
"""


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT, "tool_timeout": 60.0, "sandbox_dir": data / "sandboxes",
        "sandbox_backend": "bwrap", "sandbox_egress_allow": ALLOWED,
    }  # fmt: skip


def host_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # picks the route, sends nothing
        except OSError:
            return None
        return str(probe.getsockname()[0])


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def services(stack: Stack) -> list[tuple[int, str]]:
    """(port, protocol) of every service the stack started, and the host's own Redis."""
    found = [(urlsplit(stack.redis_url).port, "redis")]
    found += [(urlsplit(url).port, "http") for url in (stack.gateway_url, stack.dev_backend_url)]
    if listening(HOST_REDIS):
        found.append((HOST_REDIS, "redis"))
    return [(port, kind) for port, kind in found if port is not None]


def payloads(kind: str, port: int) -> list[str]:
    if kind == "redis":
        return ["PING\r\n"]
    return [
        f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        for host in ("localhost", ALLOWED)
    ]


def test_a_box_with_network_reaches_no_service_of_its_host(
    client: RolloutClient, stack: Stack
) -> None:
    addresses = ["127.0.0.1", "10.0.2.2", "10.0.2.3", *filter(None, [host_address()])]
    targets = [
        (address, port, payload)
        for port, kind in services(stack)
        for address in addresses
        for payload in payloads(kind, port)
    ]
    # Every one of them answers from the host itself: the probe can tell a service.
    for port, _kind in services(stack):
        assert listening(port)
    task = {
        "data_source": "shell",
        "instruction": "PROBE: reach the host's services.",
        "files": {"/workspace/probe.py": PROBE, "/workspace/targets.json": json.dumps(targets)},
        "check": "test -s /workspace/reached",
        "network": True,
        "egress": [ALLOWED],
    }
    job_id = client.submit_rollout(task, sampling={"seed": 0, "max_tokens": 256})
    assert isinstance(job_id, str)
    wait_until(lambda: client.get_rollout(job_id).status.terminal, 240, "the job's end")
    traj = client.get_rollout(job_id)
    assert traj.status is JobStatus.completed, traj.error
    output = "\n".join(t.text for t in traj.turns if t.type == "env")
    line = next(x for x in output.splitlines() if x.startswith("PROBED "))
    results = json.loads(line.removeprefix("PROBED "))
    assert len(results) == len(targets)
    assert not [r for r in results if r["reached"]], results
    assert traj.reward == 0.0, traj.eval
    refused = [e for e in traj.egress if not e.allowed or e.error is not None]
    # The namespace's own loopback holds nothing of the host's: those tries never left it.
    assert "10.0.2.2" in {e.address for e in refused}
