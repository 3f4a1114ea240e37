"""Where inference backends may live: the address policy applied when one is registered.

A backend URL names a host; the gateway resolves it and checks every address it resolves to
(all of them, since a client may connect to any) against the operator's allow-list of
networks, ``ROLLSERVE_BACKEND_NETWORKS`` (comma-separated CIDRs):

- no allow-list: any address, except the *special* ones below;
- an allow-list: only addresses inside a listed network.

Special addresses are the link-local ranges (169.254.0.0/16 and fe80::/10, where cloud
metadata services answer) and the metadata services' own addresses elsewhere (AWS's
fd00:ec2::254, Alibaba Cloud's 100.100.100.200, Azure's 168.63.129.16). One is allowed only
when a listed network lies inside its special range: ``169.254.0.0/16`` or
``169.254.10.0/24`` admit link-local backends, while ``0.0.0.0/0`` does not admit the
metadata service. IPv4 addresses written as IPv6 (``::ffff:169.254.169.254``) are checked as
IPv4.

A host that does not resolve is refused. Names are resolved when the backend is registered;
a name that later resolves elsewhere is not followed up here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from core.settings import IPAddress, IPNetwork

SPECIAL_NETWORKS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("fd00:ec2::254/128"),
    ipaddress.ip_network("100.100.100.200/32"),
    ipaddress.ip_network("168.63.129.16/32"),
)
"""Link-local ranges and cloud metadata addresses: allowed only when listed explicitly."""


class BackendAddressError(ValueError):
    """A backend's host does not resolve, or resolves to an address the policy refuses."""


def _plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _within(inner: IPNetwork, outer: IPNetwork) -> bool:
    if isinstance(inner, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return inner.subnet_of(outer)
    return False


def address_allowed(address: IPAddress, networks: Sequence[IPNetwork]) -> bool:
    """Whether a backend may live at `address` under the allow-list `networks` (empty: any
    address but the special ones)."""
    address = _plain(address)
    special = [net for net in SPECIAL_NETWORKS if address in net]
    if not networks:
        return not special
    for net in networks:
        if address not in net:
            continue
        if all(_within(net, s) for s in special):
            return True
    return False


def resolve(host: str) -> list[IPAddress]:
    """Every address `host` resolves to (an IP literal resolves to itself).

    Raises BackendAddressError when it does not resolve.
    """
    literal = host.strip("[]")
    try:
        return [ipaddress.ip_address(literal)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        raise BackendAddressError(f"host {host!r} does not resolve") from None
    found: list[IPAddress] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        except ValueError:
            continue
        if address not in found:
            found.append(address)
    if not found:
        raise BackendAddressError(f"host {host!r} does not resolve")
    return found


def check_addresses(
    host: str, addresses: Iterable[IPAddress], networks: Sequence[IPNetwork]
) -> None:
    """Raise BackendAddressError for the first of `host`'s addresses the policy refuses."""
    for address in addresses:
        if address_allowed(address, networks):
            continue
        plain = _plain(address)
        if any(plain in net for net in SPECIAL_NETWORKS):
            why = (
                "a link-local or cloud metadata address, refused unless "
                "ROLLSERVE_BACKEND_NETWORKS lists a network within its range"
            )
        else:
            why = "outside the networks ROLLSERVE_BACKEND_NETWORKS allows"
        shown = host if host.strip("[]") == str(address) else f"{host} ({address})"
        raise BackendAddressError(f"backend address {shown} is {why}")


def check_backend_url(url: str, networks: Sequence[IPNetwork]) -> None:
    """Resolve the host of a backend URL and check every address against the policy.

    Raises BackendAddressError (a ValueError) saying why it is refused.
    """
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise BackendAddressError("the backend URL names no host")
    check_addresses(host, resolve(host), networks)
