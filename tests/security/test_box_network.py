"""A box with network has a network of its own whose only way out is the egress proxy.

Real bubblewrap, real slirp4netns and nftables, as root. A box with network must not reach a
server on the host's loopback or on its own address (bound on 0.0.0.0), nor the embedded
Redis; by default it reaches no outside host either (refused and recorded), and with a host
on its allow-list a real download from it works and is recorded. A box without network has
loopback alone. Outside hosts are the package registries this machine reaches; tests that
need one skip when it cannot be reached.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from broker.embedded import EmbeddedRedis
from core.schemas import EgressEvent
from sandbox.base import SandboxError, SandboxSpec
from sandbox.bwrap import BubblewrapBackend, BubblewrapSandbox
from sandbox.egress import read_events
from sandbox.keeper import launch, release
from sandbox.network import missing
from sandbox.reaper import reap
from sandbox.toolclient import ToolClient
from tests.support.sandbox import Listener, find_job_processes, new_job_id

if TYPE_CHECKING:
    from tests.support.sandbox import SandboxFactory

OUTSIDE = "pypi.org"
"""A host this machine reaches (a package registry)."""
OTHER_OUTSIDE = "files.pythonhosted.org"


NetworkBoxes = Callable[..., BubblewrapSandbox]


@pytest.fixture
def network_box(bwrap_sandbox: SandboxFactory, bwrap_backend: BubblewrapBackend) -> NetworkBoxes:
    """`network_box(egress=[...])`: a bwrap sandbox with network (skips where the host cannot
    make one, saying what it lacks)."""
    lacking = missing(bwrap_backend.privileged)
    if lacking:
        pytest.skip(f"boxes with network need {', '.join(lacking)}")

    def make(**fields: Any) -> BubblewrapSandbox:
        box = bwrap_sandbox(network=True, **fields)
        assert isinstance(box, BubblewrapSandbox)
        return box

    return make


@pytest.fixture(scope="module")
def outside_address() -> str:
    """The address of `OUTSIDE` (skips when this machine cannot reach it)."""
    try:
        with socket.create_connection((OUTSIDE, 443), timeout=5) as conn:
            return str(conn.getpeername()[0])
    except OSError as exc:
        pytest.skip(f"this machine cannot reach {OUTSIDE}:443 ({exc}): offline")


def host_address() -> str:
    """This host's address on its default route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # picks the route, sends nothing
        except OSError:
            pytest.skip("this host has no route off loopback")
        return str(probe.getsockname()[0])


class AnyListener(Listener):
    """A TCP server on all the host's addresses (0.0.0.0) that counts what it accepts."""

    def __init__(self) -> None:
        super().__init__("0.0.0.0")


@pytest.fixture
def any_listener() -> Iterator[AnyListener]:
    listener = AnyListener()
    yield listener
    listener.close()


PROBE = """
import json, socket, sys
results = []
for host, port, payload in json.loads(sys.argv[1]):
    entry = {"target": f"{host}:{port}", "read": ""}
    try:
        with socket.create_connection((host, port), timeout=5) as conn:
            conn.settimeout(2)
            if payload:
                conn.sendall(payload.encode())
            while len(entry["read"]) < 300:
                chunk = conn.recv(300)
                if not chunk:
                    break
                entry["read"] += chunk.decode("latin-1")
    except OSError as exc:
        entry["error"] = str(exc)
    results.append(entry)
print(json.dumps(results))
"""


def probe(box: BubblewrapSandbox, targets: list[tuple[str, int, str]]) -> list[dict[str, str]]:
    """Connect from the box to each (host, port), send the payload, read what comes back."""
    result = box.exec(["python3", "-c", PROBE, json.dumps(targets)], timeout=60)
    assert result.returncode == 0, result
    found: list[dict[str, str]] = json.loads(result.stdout)
    return found


def http(host: str) -> str:
    return f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"


def events(box: BubblewrapSandbox, **match: Any) -> list[EgressEvent]:
    found = read_events(box.state_dir)
    return [e for e in found if all(getattr(e, k) == v for k, v in match.items())]


def test_a_network_box_reaches_no_server_on_the_hosts_loopback(
    network_box: NetworkBoxes, host_listener: Listener
) -> None:
    port = host_listener.port
    # Even a rule naming localhost (which an operator would never allow) reaches nothing.
    box = network_box(egress=[f"localhost:{port}"])
    results = probe(
        box,
        [("127.0.0.1", port, ""), ("10.0.2.2", port, ""), ("10.0.2.2", port, http("localhost"))],
    )
    assert host_listener.accepted == 0
    assert not any("hello from the host" in r["read"] for r in results), results
    [loopback] = events(box, host="localhost")
    assert loopback.allowed and loopback.error is not None and "loopback" in loopback.error


def test_a_network_box_reaches_no_server_on_the_hosts_own_address(
    network_box: NetworkBoxes, any_listener: AnyListener
) -> None:
    address = host_address()
    port = any_listener.port
    box = network_box(egress=[f"{OUTSIDE}:{port}"])
    results = probe(
        box, [(address, port, ""), (address, port, http(address)), (address, port, "\0\1")]
    )
    assert any_listener.accepted == 0
    assert not any("hello from the host" in r["read"] for r in results), results
    assert "403 Forbidden" in results[1]["read"]
    refused = events(box, address=address, allowed=False)
    assert {e.reason for e in refused} >= {
        "names an address, not a host",
        "neither TLS nor HTTP: the host cannot be named",
    }


def test_a_network_box_cannot_reach_the_embedded_redis(
    network_box: NetworkBoxes, redis_server: EmbeddedRedis
) -> None:
    assert redis_server.port is not None
    port = redis_server.port
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("stats")["total_connections_received"]
    box = network_box()
    ping = "PING\r\n"
    results = probe(
        box, [("127.0.0.1", port, ping), ("10.0.2.2", port, ping), (host_address(), port, ping)]
    )
    assert [r["read"] for r in results] == ["", "", ""], results
    assert client.info("stats")["total_connections_received"] == before
    client.close()


def test_without_an_allow_list_an_outside_host_is_refused_and_recorded(
    network_box: NetworkBoxes, outside_address: str
) -> None:
    box = network_box()
    fetch = box.exec(
        ["python3", "-c", f"import urllib.request; urllib.request.urlopen('https://{OUTSIDE}/')"],
        timeout=60,
    )
    assert fetch.returncode != 0 and "URLError" in fetch.stderr, fetch
    # By address, naming the host in TLS: the proxy refuses it all the same.
    tls = (
        "import socket, ssl\n"
        f"raw = socket.create_connection(({outside_address!r}, 443), timeout=10)\n"
        f"ssl.create_default_context().wrap_socket(raw, server_hostname={OUTSIDE!r})\n"
    )
    refused = box.exec(["python3", "-c", tls], timeout=60)
    assert refused.returncode != 0 and "ACCESS_DENIED" in refused.stderr.upper(), refused
    [lookup] = events(box, kind="dns", host=OUTSIDE)
    assert not lookup.allowed and lookup.reason == "not on the allow-list"
    [connection] = events(box, kind="connect", host=OUTSIDE)
    assert (connection.port, connection.address) == (443, outside_address)
    assert not connection.allowed and connection.reason == "not on the allow-list"


def test_with_hosts_on_the_allow_list_a_real_download_works_and_is_recorded(
    network_box: NetworkBoxes, outside_address: str
) -> None:
    box = network_box(egress=[OUTSIDE, OTHER_OUTSIDE])
    fetch = box.exec(
        ["python3", "-c",
         f"import urllib.request; print(urllib.request.urlopen('https://{OUTSIDE}/simple/six/')"
         ".status)"],
        timeout=60,
    )  # fmt: skip
    assert fetch.stdout.strip() == "200", fetch
    download = box.exec(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
         "--disable-pip-version-check", "-d", "/tmp/dl", "six==1.17.0"],
        timeout=180,
    )  # fmt: skip
    assert download.returncode == 0, download
    assert "six-1.17.0" in box.exec(["ls", "/tmp/dl"]).stdout
    elsewhere = box.exec(["python3", "-c", "import socket; socket.getaddrinfo('github.com', 443)"])
    assert elsewhere.returncode != 0
    allowed = events(box, kind="connect", allowed=True)
    assert {(e.host, e.port) for e in allowed} == {(OUTSIDE, 443), (OTHER_OUTSIDE, 443)}
    assert all(e.error is None for e in allowed), allowed
    assert events(box, kind="dns", host="github.com", allowed=False)


def test_other_traffic_is_dropped_and_lookups_answer_only_listed_names(
    network_box: NetworkBoxes,
) -> None:
    box = network_box(egress=[OUTSIDE])
    code = (
        "import socket, struct\n"
        "udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        "    udp.sendto(b'x', ('203.0.113.80', 9999)); print('udp sent')\n"
        "except OSError as exc:\n"
        "    print('udp refused', exc.errno)\n"
        "query = struct.pack('!HHHHHH', 7, 0x100, 1, 0, 0, 0) + b'\\x06github\\x03com\\x00'\n"
        "udp.sendto(query + struct.pack('!HH', 1, 1), ('8.8.8.8', 53))\n"
        "udp.settimeout(10)\n"
        "print('dns rcode', udp.recv(512)[3] & 15)\n"
    )
    result = box.exec(["python3", "-c", code], timeout=60)
    assert result.stdout.split("\n")[:2] == ["udp refused 1", "dns rcode 3"], result
    assert events(box, kind="dns", host="github.com", allowed=False)


def interfaces(box: BubblewrapSandbox) -> list[str]:
    lines = box.exec(["cat", "/proc/net/dev"]).stdout.splitlines()[2:]
    return sorted(line.split(":")[0].strip() for line in lines)


def test_a_box_without_network_has_loopback_alone(bwrap_sandbox: SandboxFactory) -> None:
    box = bwrap_sandbox(network=False)
    assert isinstance(box, BubblewrapSandbox)
    assert interfaces(box) == ["lo"]
    assert not (box.state_dir / "egress.jsonl").exists()


def test_a_network_box_has_loopback_and_its_own_tap_alone(network_box: NetworkBoxes) -> None:
    box = network_box()
    assert interfaces(box) == ["lo", "tap0"]
    ours = os.readlink("/proc/self/ns/net")
    assert box.exec(["readlink", "/proc/self/ns/net"]).stdout.strip() != ours


def test_the_tool_servers_box_and_every_exec_share_the_sandboxs_namespace(
    network_box: NetworkBoxes,
) -> None:
    box = network_box()
    box.start(tool_server=True)
    with ToolClient(box.socket_path, timeout=30) as tools:
        served = tools.call("bash", command="readlink /proc/self/ns/net")["output"].strip()
    first = box.exec(["readlink", "/proc/self/ns/net"]).stdout.strip()
    second = box.exec(["readlink", "/proc/self/ns/net"]).stdout.strip()
    assert served == first == second != os.readlink("/proc/self/ns/net")


def test_once_the_box_is_halted_it_reaches_nothing_outside(network_box: NetworkBoxes) -> None:
    box = network_box(egress=[OUTSIDE])
    box.start(tool_server=False)
    box.halt()
    lookup = box.exec(["python3", "-c", f"import socket; socket.getaddrinfo({OUTSIDE!r}, 443)"])
    assert lookup.returncode != 0
    [event] = events(box, kind="dns", host=OUTSIDE)
    assert event.reason == "the agent's turns are over"


def test_stop_ends_slirp4netns_and_the_proxy(network_box: NetworkBoxes) -> None:
    box = network_box()
    box.start(tool_server=False)
    network = box.network
    assert network is not None
    pid = network.slirp_pid
    assert Path(f"/proc/{pid}").exists()
    box.stop()
    assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(SandboxError, match="was stopped"):
        box.exec(["true"])


def test_a_kept_network_sandbox_leaves_nothing_when_its_keeper_is_killed(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    lacking = missing(bwrap_backend.privileged)
    if lacking:
        pytest.skip(f"boxes with network need {', '.join(lacking)}")
    spec = SandboxSpec(job_id=new_job_id(), network=True, egress=[OUTSIDE])
    kept = launch(spec, "bwrap", state_root)
    try:
        slirps = [
            pid for pid in find_job_processes(spec.job_id)
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"slirp4netns")
            or b"/slirp4netns\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]  # fmt: skip
        assert len(slirps) == 1
        os.kill(kept.keeper_pid, signal.SIGKILL)  # no chance to clean up
        deadline = time.monotonic() + 10
        while find_job_processes(spec.job_id) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert find_job_processes(spec.job_id) == []
        # What is left (the state dir) is the reaper's, as after any keeper that died.
        assert reap(state_root, lambda _job: False) == [kept.id]
    finally:
        release(kept)


@pytest.mark.parametrize(
    ("lacks", "words"),
    [
        ("slirp4netns", "slirp4netns (apt-get install slirp4netns)"),
        ("nft", "nft (apt-get install nftables)"),
        ("root", "the service running as root"),
    ],
)
def test_a_network_box_fails_to_start_naming_what_the_host_lacks(
    lacks: str, words: str, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = BubblewrapBackend()
    backend.available = lambda: (True, "")  # type: ignore[assignment]
    if lacks == "root":
        backend.privileged = False
    else:
        import sandbox.network

        real = sandbox.network.shutil.which

        def which(name: str, path: str | None = None) -> str | None:
            return None if name == lacks else real(name, path=path)

        monkeypatch.setattr(sandbox.network.shutil, "which", which)
    with pytest.raises(SandboxError, match="this host lacks") as caught:
        backend.create(SandboxSpec(job_id=new_job_id(), network=True), state_root)
    assert words in str(caught.value)
    assert list(state_root.iterdir()) == []  # nothing was made


def test_a_firewall_that_cannot_be_set_fails_the_start_and_leaves_nothing(
    network_box: NetworkBoxes, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.network

    real = sandbox.network._which
    monkeypatch.setattr(
        sandbox.network, "_which", lambda tool: "/bin/false" if tool == "nft" else real(tool)
    )
    box = network_box()
    with pytest.raises(SandboxError, match="cannot set the box's firewall with nft"):
        box.start(tool_server=False)
    assert find_job_processes(box.job_id) == []
    assert box.network is None


def test_egress_rules_need_a_box_with_network(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    spec = SandboxSpec(job_id=new_job_id(), egress=[OUTSIDE])
    with pytest.raises(SandboxError, match="egress rules need a box with network"):
        bwrap_backend.create(spec, state_root)
    bad = SandboxSpec(job_id=new_job_id(), network=True, egress=["10.0.0.1"])
    with pytest.raises(SandboxError, match=r"egress: '10\.0\.0\.1' is not"):
        bwrap_backend.create(bad, state_root)
