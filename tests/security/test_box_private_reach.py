"""A box with network reaches no private address through an allowed name, unless the operator
lists its network.

The attack: a host on the allow-list (or one the operator's pattern covers) whose name
resolves to an address inside the host's own networks: the resolver, the gateway, a database
next door. The egress proxy decides by name, so the name alone used to take the box there.
Here the name is made to resolve to a real private service this host reaches (its name server
or its default gateway, on a port that answers), as DNS of an attacker's domain would.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.bwrap import BubblewrapBackend, BubblewrapSandbox
from sandbox.egress import PRIVATE, is_host_address, read_events
from sandbox.network import missing
from tests.support.sandbox import sandbox_factory

NAME = "internal.rollserve.test"
"""The allowed name; it resolves to the private service for the length of a test."""
PORTS = (53, 80, 443, 22)


def _default_gateway() -> str | None:
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return socket.inet_ntoa(int(fields[2], 16).to_bytes(4, "little"))
    return None


def _name_servers() -> list[str]:
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        return []
    return [line.split()[1] for line in lines if line.startswith("nameserver ") and " " in line]


def private_service() -> tuple[str, int] | None:
    """A TCP service on a private address that is not this host's own (name server, default
    gateway), which this host reaches; None when there is none."""
    for candidate in [*_name_servers(), _default_gateway()]:
        if candidate is None:
            continue
        try:
            address = ipaddress.ip_address(candidate)
        except ValueError:
            continue
        if address.version != 4 or not any(address in net for net in PRIVATE):
            continue
        if is_host_address(address):
            continue
        for port in PORTS:
            try:
                socket.create_connection((candidate, port), timeout=3).close()
            except OSError:
                continue
            return candidate, port
    return None


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    """(address, port) of a private service; `NAME` resolves to its address meanwhile."""
    found = private_service()
    if found is None:
        pytest.skip("this host reaches no private TCP service off its own addresses")
    address, _ = found
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == NAME:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port or 0))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return found


Boxes = Callable[..., BubblewrapSandbox]


def network_boxes(backend: BubblewrapBackend, state_root: Path) -> Iterator[Boxes]:
    if not backend.available()[0]:
        pytest.skip(f"bubblewrap cannot make boxes here: {backend.available()[1]}")
    lacking = missing(backend.privileged)
    if lacking:
        pytest.skip(f"boxes with network need {', '.join(lacking)}")
    factory = sandbox_factory(backend, state_root)
    make = next(factory)

    def network_box(**fields: Any) -> BubblewrapSandbox:
        box = make(network=True, **fields)
        assert isinstance(box, BubblewrapSandbox)
        return box

    yield network_box
    next(factory, None)  # stops every box it made, checking nothing was left behind


@pytest.fixture
def default_boxes(state_root: Path) -> Iterator[Boxes]:
    yield from network_boxes(BubblewrapBackend(egress_networks=()), state_root)


REQUEST = """
import json, socket, sys
address, port, name = json.loads(sys.argv[1])
with socket.create_connection((address, port), timeout=10) as conn:
    conn.settimeout(10)
    conn.sendall(f"GET / HTTP/1.1\\r\\nHost: {name}\\r\\nConnection: close\\r\\n\\r\\n".encode())
    print(conn.recv(200).decode("latin-1").split("\\r\\n")[0])
"""


def ask(box: BubblewrapSandbox, address: str, port: int) -> str:
    result = box.exec(["python3", "-c", REQUEST, json.dumps([address, port, NAME])], timeout=60)
    return result.stdout.strip()


def test_an_allowed_name_that_resolves_to_a_private_address_is_not_connected(
    default_boxes: Boxes, service: tuple[str, int]
) -> None:
    address, port = service
    box = default_boxes(egress=[f"{NAME}:{port}"])
    assert ask(box, address, port).startswith("HTTP/1.1 502"), "the proxy connected"
    [event] = [e for e in read_events(box.state_dir) if e.host == NAME]
    assert event.allowed and event.error is not None
    assert "a private address" in event.error and "ROLLSERVE_SANDBOX_EGRESS_NETWORKS" in event.error
    lookup = box.exec(["python3", "-c", f"import socket; print(socket.gethostbyname({NAME!r}))"])
    assert lookup.returncode != 0 and address not in lookup.stdout


def test_a_private_network_the_operator_lists_is_reached(
    state_root: Path, service: tuple[str, int]
) -> None:
    address, port = service
    listed = ipaddress.ip_network(f"{address}/32")
    for make in network_boxes(BubblewrapBackend(egress_networks=[listed]), state_root):
        box = make(egress=[f"{NAME}:{port}"])
        ask(box, address, port)
        [event] = [e for e in read_events(box.state_dir) if e.host == NAME]
        assert event.allowed and event.error is None, event
        assert box.exec(["getent", "hosts", NAME]).stdout.split()[:1] == [address]
