"""The egress proxy's parts without namespaces: naming a connection from its first bytes, the
DNS answers, the addresses no box may reach, the record, and the proxy on host sockets."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.egress import parse_task_rules
from sandbox.egress import (
    EgressProxy,
    EventLog,
    dns_response,
    is_host_address,
    parse_dns_query,
    read_events,
    refused_address,
    sniff,
    tls_server_name,
)

BOX_NETWORK = ipaddress.IPv4Network("10.0.2.0/24")


def client_hello(server_name: str | None) -> bytes:
    """The first bytes a real TLS client (Python's ssl) sends."""
    context = ssl.create_default_context()
    if server_name is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_a_tls_client_hello_names_its_server_once_complete() -> None:
    hello = client_hello("files.pythonhosted.org")
    assert tls_server_name(hello) == (True, "files.pythonhosted.org")
    assert sniff(hello) == ("tls", True, "files.pythonhosted.org")
    for cut in (1, 5, 40, len(hello) - 1):
        assert tls_server_name(hello[:cut]) == (False, None)


def test_a_client_hello_split_over_two_records_still_names_its_server() -> None:
    hello = client_hello("pypi.org")
    body = hello[5:]
    first, second = body[:100], body[100:]
    records = b"".join(
        b"\x16" + hello[1:3] + struct.pack("!H", len(part)) + part for part in (first, second)
    )
    assert tls_server_name(records) == (True, "pypi.org")


def test_a_client_hello_without_a_server_name_names_none() -> None:
    assert tls_server_name(client_hello(None)) == (True, None)


def test_an_http_request_names_its_host_without_the_port() -> None:
    request = b"GET /simple/ HTTP/1.1\r\nAccept: */*\r\nhost: PyPI.org:8080\r\n\r\n"
    assert sniff(request) == ("http", True, "PyPI.org")
    assert sniff(request[:20]) == ("http", False, None)
    assert sniff(b"GE") == ("http", False, None)
    assert sniff(b"GET / HTTP/1.0\r\n\r\n") == ("http", True, None)


def test_a_proxy_request_and_other_protocols_name_no_host() -> None:
    assert sniff(b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n") == ("connect", True, None)
    assert sniff(b"SSH-2.0-OpenSSH_9.2\r\n") == ("other", True, None)
    assert sniff(b"\x00\x01binary") == ("other", True, None)


def dns_query(name: str, qtype: int = 1, query_id: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return (
        struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack("!HH", qtype, 1)
    )


def test_a_dns_query_is_read_and_answered_with_a_records() -> None:
    query = dns_query("PyPI.org")
    name, qtype, end = parse_dns_query(query) or ("", 0, 0)
    assert (name, qtype, end) == ("pypi.org", 1, len(query))
    answer = dns_response(query[:end], 0, ["203.0.113.80", "203.0.113.81"])
    query_id, flags, questions, answers = struct.unpack("!HHHH", answer[:8])
    assert (query_id, flags & 0x8000, flags & 0xF, questions, answers) == (0x1234, 0x8000, 0, 1, 2)
    assert answer[-4:] == socket.inet_aton("203.0.113.81")
    refused = dns_response(query[:end], 3, ["203.0.113.80"])
    assert struct.unpack("!HH", refused[2:6]) == (0x8183, 1) and len(refused) == len(query)


def test_what_is_not_a_standard_query_gets_no_answer() -> None:
    assert parse_dns_query(b"\x00" * 5) is None
    reply = bytearray(dns_query("pypi.org"))
    reply[2] |= 0x80  # a response, not a query
    assert parse_dns_query(bytes(reply)) is None


def primary_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # picks a route; sends nothing
        except OSError:
            pytest.skip("this host has no route off loopback")
        return str(probe.getsockname()[0])


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("169.254.169.254", "link-local"),
        ("0.0.0.0", "not a host's address"),
        ("224.0.0.1", "not a host's address"),
        ("10.0.2.2", "an address of the service's network"),
        ("100.100.100.200", "an address of the service's network"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
    ],
)
def test_addresses_no_box_may_reach(address: str, why: str) -> None:
    assert refused_address(ipaddress.ip_address(address), BOX_NETWORK) == why


def test_the_hosts_own_address_is_refused_and_an_outside_one_is_not() -> None:
    own = ipaddress.ip_address(primary_address())
    assert is_host_address(own)
    assert refused_address(own, BOX_NETWORK) == "an address of this host"
    assert refused_address(ipaddress.ip_address("203.0.113.80"), BOX_NETWORK) is None


@pytest.mark.parametrize(
    "address", ["10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "198.18.0.1", "fd00::1"]
)
def test_a_private_address_is_refused_unless_its_network_is_listed(address: str) -> None:
    private = ipaddress.ip_address(address)
    why = refused_address(private, BOX_NETWORK)
    assert why is not None and why.startswith("a private address")
    listed = [ipaddress.ip_network(f"{address}/{private.max_prefixlen}")]
    assert refused_address(private, BOX_NETWORK, listed) is None


def test_listing_a_network_never_opens_loopback_metadata_or_the_boxs_own_network() -> None:
    everything = [ipaddress.ip_network("0.0.0.0/0")]
    for address in ("127.0.0.1", "169.254.169.254", "10.0.2.2", "100.100.100.200"):
        assert refused_address(ipaddress.ip_address(address), BOX_NETWORK, everything)


def test_the_record_stops_at_its_cap_and_says_so(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "egress.jsonl", limit=3)
    for port in range(5):
        log.record(host="pypi.org", port=port, allowed=True)
    events = read_events(tmp_path)
    assert [e.kind for e in events] == ["connect", "connect", "connect", "log_full"]
    assert [e.port for e in events[:3]] == [0, 1, 2]
    assert read_events(tmp_path / "missing") == []


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[EgressProxy]:
    """A proxy on the host's loopback (no namespace, so no original destination: a
    connection's port is the listener's), allowing `localhost` on that port."""
    listener = socket.create_server(("127.0.0.1", 0))
    resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resolver.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    box = EgressProxy(
        parse_task_rules([f"localhost:{port}", f"example.org:{port}"]),
        listener=listener,
        resolver=resolver,
        outbound=lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
        log=EventLog(tmp_path / "egress.jsonl"),
        box_network=BOX_NETWORK,
    )
    box.start()
    yield box
    box.close()


def ask(proxy: EgressProxy, request: bytes) -> bytes:
    port = proxy._listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=15) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
    return data


def test_the_proxy_refuses_a_host_off_the_list_and_records_why(
    proxy: EgressProxy, tmp_path: Path
) -> None:
    answer = ask(proxy, b"GET / HTTP/1.1\r\nHost: github.com\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert b"github.com" in answer and b"not on the allow-list" in answer
    [event] = read_events(tmp_path)
    assert (event.host, event.allowed, event.reason) == (
        "github.com",
        False,
        "not on the allow-list",
    )


def test_an_allowed_name_that_resolves_to_loopback_is_never_connected(
    proxy: EgressProxy, tmp_path: Path
) -> None:
    answer = ask(proxy, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 502 ")
    [event] = read_events(tmp_path)
    assert event.allowed and event.error is not None and "loopback" in event.error


def test_the_proxy_answers_lookups_only_for_listed_names(
    proxy: EgressProxy, tmp_path: Path
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(10)
        client.sendto(dns_query("github.com"), proxy._resolver.getsockname())
        refused = client.recv(512)
        client.sendto(dns_query("example.org", qtype=28), proxy._resolver.getsockname())
        empty = client.recv(512)
    assert refused[3] & 0xF == 3  # NXDOMAIN
    assert empty[3] & 0xF == 0 and struct.unpack("!H", empty[6:8]) == (0,)
    [event] = read_events(tmp_path)
    assert (event.kind, event.host, event.allowed) == ("dns", "github.com", False)


def test_after_close_egress_everything_is_refused(proxy: EgressProxy, tmp_path: Path) -> None:
    proxy.close_egress("the agent's turns are over")
    answer = ask(proxy, b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n")
    assert b"the agent's turns are over" in answer
    assert read_events(tmp_path)[0].reason == "the agent's turns are over"
