"""The egress proxy of a sandbox with network: it decides, by host name, every TCP connection
the box opens and every name it looks up, and records each decision.

The box's firewall (`sandbox.network`) sends every outbound TCP connection to the proxy's
listener and every DNS query to its resolver, both sockets in the box's own network
namespace. The proxy runs in the service's process, in the host's namespace:

- **TCP**: the destination's name comes from the connection's first bytes (the server name
  of a TLS ClientHello, the `Host` header of an HTTP request), its port from the address the
  box aimed at. A connection that names no host, or a host and port no rule allows, is
  refused (a TLS `access_denied` alert, or an HTTP 403). An allowed one is resolved by the
  host (the box's choice of address is ignored), the addresses the box must never reach are
  dropped (the host's own, loopback, link-local, cloud metadata, the box's own network, and
  private ranges the operator did not list in `ROLLSERVE_SANDBOX_EGRESS_NETWORKS`), and
  the proxy connects from the box's namespace, through slirp4netns, then relays the bytes.
- **DNS**: A queries for a name a rule allows are answered with the addresses the host
  resolves; any other name is answered NXDOMAIN and recorded; other query types of an allowed
  name get an empty answer (the box has no IPv6 route).

Every decision is a JSON line in `<state dir>/egress.jsonl` (`EgressEvent`), at most
`MAX_EVENTS` of them. What it does not see: inside TLS, a request may name another host the
same server also serves (domain fronting); on plain HTTP only the first request's `Host` is
checked.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.egress import HostRule, allows, names_host, normal_host, valid_host_name
from core.schemas import EgressEvent

LOG_NAME = "egress.jsonl"
"""The decisions of a sandbox's egress proxy, in its state dir."""
MAX_EVENTS = 2000
"""Decisions recorded per sandbox; after them one `log_full` event, then none."""
MAX_CONNECTIONS = 64
"""Connections one box may have open through the proxy at once."""
MAX_LOOKUPS = 16
"""Name lookups of one box answered at once; more queries meanwhile are dropped."""
SNIFF_BYTES = 64 << 10
"""Most bytes read from a connection before its host name must be known."""
SNIFF_SECONDS = 10.0
"""How long a connection may take to send the bytes that name its host."""
CONNECT_SECONDS = 10.0
DNS_TTL = 60
PRIVATE_SETTING = "ROLLSERVE_SANDBOX_EGRESS_NETWORKS"
"""The setting naming the private networks an allowed host may resolve into."""

SO_ORIGINAL_DST = 80
_TLS_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"
_HTTP_METHODS = (b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE")
# Addresses no box may reach even when an allowed name resolves to them.
_METADATA = tuple(
    ipaddress.ip_network(n) for n in ("100.100.100.200/32", "168.63.129.16/32", "192.0.0.192/32")
)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
PRIVATE: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "198.18.0.0/15",
              "fc00::/7")
)  # fmt: skip
"""Private ranges (RFC 1918, shared address space, benchmarking, unique local): the networks
of a site, which an allowed name must not lead a box into unless the operator lists them."""
SocketFactory = Callable[[], socket.socket]


# --- The record of decisions -----------------------------------------------------------------


class EventLog:
    """Appends decisions to a JSON-lines file, at most `limit` of them (thread-safe)."""

    def __init__(self, path: Path, limit: int = MAX_EVENTS) -> None:
        self.path = path
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def record(self, **fields: Any) -> None:
        event = EgressEvent(time=time.time(), **fields)
        with self._lock:
            if self._count > self.limit:
                return
            if self._count == self.limit:
                event = EgressEvent(time=event.time, kind="log_full")
            self._count += 1
            line = event.model_dump_json(exclude_none=True) + "\n"
            with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as file:
                file.write(line)


def read_events(state_dir: Path) -> list[EgressEvent]:
    """The decisions recorded in `state_dir` so far (empty when there are none)."""
    try:
        lines = (state_dir / LOG_NAME).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        with contextlib.suppress(ValueError):
            events.append(EgressEvent.model_validate(json.loads(line)))
    return events


# --- What a connection's first bytes name ----------------------------------------------------


def tls_server_name(data: bytes) -> tuple[bool, str | None]:
    """(done, name) for the start of a TLS stream: done is False while the ClientHello is
    incomplete; name is its server name, None when it has none (or is not a ClientHello)."""
    handshake = b""
    pos = 0
    while pos + 5 <= len(data):
        if data[pos] != 0x16:
            return True, None
        length = int.from_bytes(data[pos + 3 : pos + 5], "big")
        if pos + 5 + length > len(data):
            return False, None
        handshake += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 0x01:
                return True, None
            size = int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= 4 + size:
                return True, _hello_server_name(handshake[4 : 4 + size])
    return False, None


def _hello_server_name(hello: bytes) -> str | None:
    try:
        pos = 2 + 32  # version, random
        pos += 1 + hello[pos]  # session id
        pos += 2 + int.from_bytes(hello[pos : pos + 2], "big")  # cipher suites
        pos += 1 + hello[pos]  # compression methods
        end = pos + 2 + int.from_bytes(hello[pos : pos + 2], "big")
        pos += 2
        while pos + 4 <= end:
            kind = int.from_bytes(hello[pos : pos + 2], "big")
            size = int.from_bytes(hello[pos + 2 : pos + 4], "big")
            body = hello[pos + 4 : pos + 4 + size]
            pos += 4 + size
            if kind != 0:  # server_name
                continue
            at = 2
            while at + 3 <= len(body):
                name_type = body[at]
                name_len = int.from_bytes(body[at + 1 : at + 3], "big")
                name = body[at + 3 : at + 3 + name_len]
                if name_type == 0:
                    return name.decode("ascii")
                at += 3 + name_len
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def http_host(data: bytes) -> tuple[bool, str | None]:
    """(done, name) for the start of an HTTP/1 request: done is False until its headers end;
    name is its `Host` without a port, None when it has none."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False, None
    for line in data[:end].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"host":
            host = value.strip().decode("ascii", "replace")
            if host.startswith("["):
                return True, host  # an IPv6 address: never a valid name
            return True, host.rsplit(":", 1)[0] if ":" in host else host
    return True, None


def sniff(data: bytes) -> tuple[str, bool, str | None]:
    """(protocol, done, name) for a connection's first bytes (at least one): protocol is
    `tls`, `http`, `connect` (a request to a proxy) or `other`; done is False while more
    bytes are needed to tell."""
    if data[:1] == b"\x16":
        return ("tls", *tls_server_name(data))
    word, space, _ = data.partition(b" ")
    if not space:
        if any(m.startswith(word) for m in (*_HTTP_METHODS, b"CONNECT")):
            return "http", False, None
        return "other", True, None
    if word == b"CONNECT":
        return "connect", True, None
    if word in _HTTP_METHODS:
        return ("http", *http_host(data))
    return "other", True, None


# --- Which addresses a box may reach -----------------------------------------------------------


def is_host_address(address: Address) -> bool:
    """True if `address` is one of this host's own (it can be bound here)."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def refused_address(
    address: Address, box_network: ipaddress.IPv4Network, private: Sequence[Network] = ()
) -> str | None:
    """Why a box may not reach `address` (None: it may). Loopback, link-local, cloud metadata,
    the box's own network and this host's addresses are refused whatever `private` says; an
    address in a `PRIVATE` range only when no network of `private` (the operator's
    `ROLLSERVE_SANDBOX_EGRESS_NETWORKS`) holds it."""
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return "not a host's address"
    if any(address in net for net in _METADATA) or address in box_network:
        return "an address of the service's network"
    if is_host_address(address):
        return "an address of this host"
    if any(address in net for net in PRIVATE) and not any(address in net for net in private):
        return f"a private address ({PRIVATE_SETTING} does not list it)"
    return None


def resolve(
    name: str, port: int, box_network: ipaddress.IPv4Network, private: Sequence[Network] = ()
) -> list[str]:
    """The IPv4 addresses of `name` a box may reach (`refused_address`); OSError when the
    name does not resolve, or resolves only to addresses it may not reach."""
    infos = socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)
    found = list(dict.fromkeys(str(info[4][0]) for info in infos))
    why = [refused_address(ipaddress.ip_address(a), box_network, private) for a in found]
    usable = [a for a, refused in zip(found, why, strict=True) if refused is None]
    if not usable:
        raise OSError(
            f"{name} resolves only to addresses boxes may not reach ({why[0] if why else None})"
        )
    return usable


# --- The proxy ----------------------------------------------------------------------------------


class EgressProxy:
    """Serves one box: its TCP listener and DNS socket (made in the box's namespace),
    `outbound()` making sockets that leave through the box's namespace, `rules` the hosts it
    may reach. `close_egress` refuses everything from then on; `close` ends all of it."""

    def __init__(
        self,
        rules: Sequence[HostRule],
        *,
        listener: socket.socket,
        resolver: socket.socket,
        outbound: SocketFactory,
        log: EventLog,
        box_network: ipaddress.IPv4Network,
        private: Sequence[Network] = (),
    ) -> None:
        self.rules = tuple(rules)
        self.private = tuple(private)
        self.log = log
        self._listener = listener
        self._resolver = resolver
        self._outbound = outbound
        self._box_network = box_network
        self._closed_reason: str | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lookups = threading.BoundedSemaphore(MAX_LOOKUPS)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._last_refused_lookup: tuple[str, float] = ("", 0.0)
        self._threads = [
            threading.Thread(target=self._accept_loop, name="egress-accept", daemon=True),
            threading.Thread(target=self._dns_loop, name="egress-dns", daemon=True),
        ]

    def start(self) -> None:
        for sock in (self._listener, self._resolver):
            sock.settimeout(0.5)
        for thread in self._threads:
            thread.start()

    def close_egress(self, reason: str) -> None:
        """Refuse every later connection and lookup, saying `reason`."""
        self._closed_reason = reason

    def close(self) -> None:
        """Stop serving and cut every open connection."""
        with self._lock:
            self._stop.set()
            socks = [self._listener, self._resolver, *self._open]
            self._open.clear()
        with contextlib.suppress(OSError):  # a UDP socket wakes from a datagram, not shutdown
            self._resolver.sendto(b"", self._resolver.getsockname())
        for sock in socks:
            # Wakes a thread blocked on it (accept, recv, select).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5.0)
        for sock in socks:
            sock.close()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._open.add(sock)
            return True

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)
        for sock in socks:
            sock.close()

    def _refusal(self, name: str, port: int) -> str | None:
        """Why a connection to `name` on `port` is refused (None: it is allowed)."""
        if self._closed_reason is not None:
            return self._closed_reason
        if not valid_host_name(normal_host(name)):
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(name.strip("[]"))
                return "names an address, not a host"
            return "not a host name"
        if not allows(self.rules, name, port):
            return "not on the allow-list"
        return None

    # TCP.

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self.log.record(allowed=False, reason="too many open connections")
                conn.close()
                continue
            if not self._track(conn):
                self._slots.release()
                conn.close()
                return
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            upstream = self._handle(conn)
            if upstream is not None:
                _relay(conn, upstream, self._stop)
        except (OSError, ValueError):  # ValueError: a socket closed by `close` meanwhile
            pass
        finally:
            self._untrack(*(s for s in (conn, upstream) if s is not None))
            self._slots.release()

    def _handle(self, conn: socket.socket) -> socket.socket | None:
        """Decide `conn` and record it; the upstream socket when it was allowed and opened."""
        address, port = _original_destination(conn, self._listener)
        protocol, data, name = _read_name(conn)
        where: dict[str, Any] = {"host": name, "port": port, "address": address}
        reason = None
        if protocol == "connect":
            reason = "a proxy request (CONNECT): connect to the host directly"
        elif protocol == "other":
            reason = "neither TLS nor HTTP: the host cannot be named"
        elif name is None:
            reason = "names no host (TLS without a server name, HTTP without Host)"
        else:
            name = normal_host(name)
            where["host"] = name
            reason = self._refusal(name, port)
        if reason is not None:
            self.log.record(allowed=False, reason=reason, **where)
            _refuse(conn, protocol, f"egress to {name or address}:{port} is refused: {reason}")
            return None
        assert name is not None
        try:
            targets = resolve(name, port, self._box_network, self.private)
            upstream = self._connect(targets, port)
        except OSError as exc:
            self.log.record(allowed=True, error=str(exc) or type(exc).__name__, **where)
            _refuse(conn, protocol, f"egress to {name}:{port} failed: {exc}", status=502)
            return None
        self.log.record(allowed=True, **where)
        if data:
            upstream.sendall(data)
        return upstream

    def _connect(self, targets: list[str], port: int) -> socket.socket:
        error: OSError = OSError("no address")
        for target in targets:
            sock = self._outbound()
            if not self._track(sock):
                sock.close()
                raise OSError("the sandbox is stopping")
            sock.settimeout(CONNECT_SECONDS)
            try:
                sock.connect((target, port))
            except OSError as exc:
                self._untrack(sock)
                error = exc
                continue
            sock.settimeout(None)
            return sock
        raise error

    # DNS.

    def _dns_loop(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self._resolver.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if not query or not self._lookups.acquire(blocking=False):
                continue
            threading.Thread(target=self._answer, args=(query, peer), daemon=True).start()

    def _answer(self, query: bytes, peer: Any) -> None:
        try:
            self._answer_query(query, peer)
        finally:
            self._lookups.release()

    def _answer_query(self, query: bytes, peer: Any) -> None:
        parsed = parse_dns_query(query)
        if parsed is None:
            return
        name, qtype, question_end = parsed
        addresses: list[str] = []
        code = 0
        if self._closed_reason is not None or not names_host(self.rules, name):
            code = 3  # NXDOMAIN
            self._record_refused_lookup(name)
        elif qtype == 1:  # A
            try:
                addresses = resolve(name, 0, self._box_network, self.private)
            except socket.gaierror as exc:
                code = 3 if exc.errno == socket.EAI_NONAME else 2
            except OSError:
                code = 3
        with contextlib.suppress(OSError):
            self._resolver.sendto(dns_response(query[:question_end], code, addresses), peer)

    def _record_refused_lookup(self, name: str) -> None:
        # A lookup asks for A and AAAA at once: record a name once, not once per query.
        last, when = self._last_refused_lookup
        now = time.monotonic()
        if last == name and now - when < 2.0:
            return
        self._last_refused_lookup = (name, now)
        reason = self._closed_reason or "not on the allow-list"
        self.log.record(kind="dns", host=name, allowed=False, reason=reason)


def parse_dns_query(packet: bytes) -> tuple[str, int, int] | None:
    """(name, query type, end of the question) of a standard DNS query with one question,
    or None for anything else."""
    if len(packet) < 12:
        return None
    _id, flags, questions = struct.unpack("!HHH", packet[:6])
    if flags & 0x8000 or (flags >> 11) & 0xF or questions != 1:
        return None
    labels, pos = [], 12
    while pos < len(packet) and packet[pos]:
        size = packet[pos]
        if size > 63:
            return None
        labels.append(packet[pos + 1 : pos + 1 + size])
        pos += 1 + size
    if pos + 5 > len(packet):
        return None
    qtype = struct.unpack("!H", packet[pos + 1 : pos + 3])[0]
    try:
        name = b".".join(labels).decode("ascii").lower()
    except UnicodeDecodeError:
        return None
    return name, qtype, pos + 5


def dns_response(header_and_question: bytes, code: int, addresses: Sequence[str]) -> bytes:
    """The answer to a query (its header and question as sent): `code` and A records."""
    query_id, flags = struct.unpack("!HH", header_and_question[:4])
    flags = 0x8000 | (flags & 0x0100) | 0x0080 | code  # response, RD as asked, RA
    answers = addresses[:16] if code == 0 else []
    out = struct.pack("!HHHHHH", query_id, flags, 1, len(answers), 0, 0)
    out += header_and_question[12:]
    for address in answers:
        out += struct.pack("!HHHIH", 0xC00C, 1, 1, DNS_TTL, 4) + socket.inet_aton(address)
    return out


# --- Helpers of a connection --------------------------------------------------------------------


def _original_destination(conn: socket.socket, listener: socket.socket) -> tuple[str, int]:
    """The address and port the box connected to, before the firewall sent it here (the
    listener's own when it connected to the listener itself)."""
    try:
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        address, port = listener.getsockname()[:2]
        return str(address), int(port)
    port, packed = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(packed), port


def _read_name(conn: socket.socket) -> tuple[str, bytes, str | None]:
    """(protocol, bytes read, name) from the start of `conn`, read until its name is known,
    `SNIFF_BYTES` were read or `SNIFF_SECONDS` passed."""
    data = b""
    deadline = time.monotonic() + SNIFF_SECONDS
    while len(data) < SNIFF_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(SNIFF_BYTES - len(data))
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
        protocol, done, name = sniff(data)
        if done:
            conn.settimeout(None)
            return protocol, data, name
    conn.settimeout(None)
    return ("other" if not data else sniff(data)[0]), data, None


def _refuse(conn: socket.socket, protocol: str, message: str, status: int = 403) -> None:
    """Tell the box its connection is refused, in its protocol, and close it."""
    with contextlib.suppress(OSError):
        if protocol == "tls":
            conn.sendall(_TLS_ACCESS_DENIED)
        elif protocol in ("http", "connect"):
            body = (message + "\n").encode()
            title = "Forbidden" if status == 403 else "Bad Gateway"
            head = f"HTTP/1.1 {status} {title}\r\nContent-Type: text/plain\r\n"
            head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            conn.sendall(head.encode() + body)


def _relay(a: socket.socket, b: socket.socket, stop: threading.Event) -> None:
    """Copy bytes both ways until both sides have finished (or the proxy stops)."""
    peer = {a: b, b: a}
    reading = [a, b]
    while reading and not stop.is_set():
        ready, _, _ = select.select(reading, [], [], 1.0)
        for sock in ready:
            chunk = sock.recv(1 << 16)
            if chunk:
                peer[sock].sendall(chunk)
                continue
            reading.remove(sock)
            with contextlib.suppress(OSError):
                peer[sock].shutdown(socket.SHUT_WR)
