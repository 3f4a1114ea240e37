"""The grammar of egress rules: which hosts a sandbox with network may connect to.

A rule names a host and, optionally, a port: `pypi.org`, `files.pythonhosted.org:443`. A rule
without a port allows the web's two ports, 443 and 80. The operator's cap
(`ROLLSERVE_SANDBOX_EGRESS_ALLOW`) may also hold suffix patterns, `*.pythonhosted.org`, which
match every name under `pythonhosted.org` (not `pythonhosted.org` itself). A task's own rules
(its `egress` list) are host names, each of which the operator's cap must cover.

Host names are ASCII (an international name in its `xn--` form), compared without case and
without a trailing dot. IP addresses are never rules: the egress proxy decides by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_PORTS: tuple[int, ...] = (443, 80)
"""The ports a rule without one allows."""
MAX_RULES = 64
"""Most rules one task may give."""

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


class EgressRuleError(ValueError):
    """A rule that cannot be read, or a task rule the operator's cap does not cover."""


def normal_host(name: str) -> str:
    """`name` lower-cased, without a trailing dot."""
    return name.lower().removesuffix(".")


def valid_host_name(name: str) -> bool:
    """True for a DNS host name in ASCII (as `normal_host` gives it), not an IP address."""
    if not name or len(name) > 253 or not _NAME.fullmatch(name):
        return False
    return not name.rsplit(".", 1)[-1].isdigit()  # 10.0.0.1 is an address, not a name


@dataclass(frozen=True)
class HostRule:
    """One host (or, as `*.suffix`, every host under a domain) and the ports it allows."""

    host: str
    """A host name, or `*.` and a domain for every name under it."""
    ports: tuple[int, ...] = DEFAULT_PORTS

    @property
    def pattern(self) -> bool:
        return self.host.startswith("*.")

    def matches_host(self, name: str) -> bool:
        """True if the rule names `name` (any port)."""
        name = normal_host(name)
        if self.pattern:
            return name.endswith(self.host[1:])
        return name == self.host

    def matches(self, name: str, port: int) -> bool:
        """True if the rule allows a connection to `name` on `port`."""
        return port in self.ports and self.matches_host(name)

    def covers(self, other: HostRule) -> bool:
        """True if everything `other` allows, this rule allows too."""
        if not set(other.ports) <= set(self.ports):
            return False
        if other.pattern:
            return self.pattern and other.host.endswith(self.host[1:])
        return self.matches_host(other.host)

    def __str__(self) -> str:
        return self.host if self.ports == DEFAULT_PORTS else f"{self.host}:{self.ports[0]}"


def parse_rule(text: object, *, patterns: bool = False) -> HostRule:
    """The rule `text` spells (`host`, `host:port`, and with `patterns` also `*.domain` and
    `*.domain:port`); EgressRuleError saying what is wrong otherwise (also for a non-string)."""
    if not isinstance(text, str):
        raise EgressRuleError(f"{text!r} is not a host name (a string)")
    raw = text.strip()
    host, sep, port_text = raw.rpartition(":") if ":" in raw else (raw, "", "")
    ports = DEFAULT_PORTS
    if sep:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise EgressRuleError(f"{text!r}: the port must be a number from 1 to 65535")
        ports = (int(port_text),)
    host = normal_host(host)
    name = host[2:] if patterns and host.startswith("*.") else host
    if not valid_host_name(name):
        kinds = "a host name or a pattern like *.example.org" if patterns else "a host name"
        raise EgressRuleError(
            f"{text!r} is not {kinds} (ASCII letters, digits, `-` and dots, not an IP address; "
            "an optional :port)"
        )
    return HostRule(host, ports)


def parse_allow_list(text: str | None) -> tuple[HostRule, ...]:
    """The operator's cap: a comma-separated list of host names and `*.domain` patterns,
    each with an optional `:port` (empty for None or blank text)."""
    if text is None:
        return ()
    return tuple(parse_rule(item, patterns=True) for item in text.split(",") if item.strip())


def parse_task_rules(items: Sequence[object]) -> tuple[HostRule, ...]:
    """A task's rules: host names with an optional `:port`, no patterns, at most
    `MAX_RULES`."""
    if len(items) > MAX_RULES:
        raise EgressRuleError(f"holds {len(items)} hosts; at most {MAX_RULES} are allowed")
    return tuple(parse_rule(item) for item in items)


def uncovered(rules: Iterable[HostRule], cap: Sequence[HostRule]) -> list[HostRule]:
    """The rules of `rules` no rule of `cap` covers."""
    return [rule for rule in rules if not any(allowed.covers(rule) for allowed in cap)]


def allows(rules: Sequence[HostRule], name: str, port: int) -> bool:
    """True if a rule of `rules` allows a connection to `name` on `port`."""
    return any(rule.matches(name, port) for rule in rules)


def names_host(rules: Sequence[HostRule], name: str) -> bool:
    """True if a rule of `rules` names `name`, on any port (what a name lookup needs)."""
    return any(rule.matches_host(name) for rule in rules)
