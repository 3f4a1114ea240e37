"""Egress rules: what a rule spells, what it allows, and which rules the operator's cap covers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.egress import (
    DEFAULT_PORTS,
    MAX_RULES,
    EgressRuleError,
    HostRule,
    allows,
    names_host,
    parse_allow_list,
    parse_rule,
    parse_task_rules,
    uncovered,
)
from core.settings import Settings


def test_a_host_without_a_port_allows_https_and_http() -> None:
    rule = parse_rule("PyPI.org.")
    assert rule == HostRule("pypi.org", DEFAULT_PORTS)
    assert rule.matches("pypi.org", 443) and rule.matches("PYPI.ORG", 80)
    assert not rule.matches("pypi.org", 22)
    assert not rule.matches("evil-pypi.org", 443) and not rule.matches("x.pypi.org", 443)


def test_a_host_with_a_port_allows_that_port_alone() -> None:
    rule = parse_rule("example.org:8443")
    assert rule.ports == (8443,)
    assert rule.matches("example.org", 8443) and not rule.matches("example.org", 443)
    assert str(rule) == "example.org:8443" and str(parse_rule("example.org")) == "example.org"


@pytest.mark.parametrize(
    "text",
    ["", "10.0.0.1", "10.0.0.1:443", "[::1]:80", "exa mple.org", "-x.org", "x.org:0",
     "x.org:65536", "x.org:https", "*.x.org", "ex\u00e4mple.org", "a" * 64 + ".org",
     "http://x.org", "x.org/path"],
)  # fmt: skip
def test_a_task_rule_is_a_host_name_with_an_optional_port(text: str) -> None:
    with pytest.raises(EgressRuleError):
        parse_rule(text)


def test_a_suffix_pattern_matches_names_under_the_domain_not_the_domain() -> None:
    rule = parse_rule("*.pythonhosted.org", patterns=True)
    assert rule.matches("files.pythonhosted.org", 443)
    assert rule.matches("a.b.pythonhosted.org", 80)
    assert not rule.matches("pythonhosted.org", 443)
    assert not rule.matches("evilpythonhosted.org", 443)


def test_the_operators_list_is_comma_separated_and_blank_is_empty() -> None:
    assert parse_allow_list(None) == () and parse_allow_list(" , ") == ()
    cap = parse_allow_list("pypi.org, *.pythonhosted.org ,registry.npmjs.org:443")
    assert [str(rule) for rule in cap] == [
        "pypi.org", "*.pythonhosted.org", "registry.npmjs.org:443"
    ]  # fmt: skip
    with pytest.raises(EgressRuleError, match=r"'10\.1\.1\.1'"):
        parse_allow_list("pypi.org,10.1.1.1")


def test_the_cap_covers_a_task_rule_only_for_names_and_ports_it_allows() -> None:
    cap = parse_allow_list("pypi.org,*.pythonhosted.org,registry.npmjs.org:443")
    task = parse_task_rules(
        ["pypi.org", "files.pythonhosted.org", "pypi.org:80", "registry.npmjs.org:443",
         "registry.npmjs.org", "pythonhosted.org", "pypi.org:22", "github.com"]
    )  # fmt: skip
    assert [str(rule) for rule in uncovered(task, cap)] == [
        "registry.npmjs.org", "pythonhosted.org", "pypi.org:22", "github.com"
    ]  # fmt: skip
    assert uncovered(task, ()) == list(task)  # no cap: nothing is allowed


def test_a_task_gives_at_most_so_many_rules() -> None:
    with pytest.raises(EgressRuleError, match="at most"):
        parse_task_rules([f"h{i}.example.org" for i in range(MAX_RULES + 1)])


def test_a_connection_needs_name_and_port_and_a_lookup_the_name() -> None:
    rules = parse_task_rules(["pypi.org", "example.org:8443"])
    assert allows(rules, "pypi.org", 443) and allows(rules, "example.org", 8443)
    assert not allows(rules, "example.org", 443) and not allows((), "pypi.org", 443)
    assert names_host(rules, "example.org") and not names_host(rules, "github.com")


def test_the_setting_refuses_an_entry_that_is_not_a_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSERVE_SANDBOX_EGRESS_ALLOW", "pypi.org,*.pythonhosted.org")
    assert [str(r) for r in Settings().sandbox_egress_cap] == ["pypi.org", "*.pythonhosted.org"]
    monkeypatch.setenv("ROLLSERVE_SANDBOX_EGRESS_ALLOW", "pypi.org,http://x")
    with pytest.raises(ValidationError, match="http://x"):
        Settings()
    monkeypatch.delenv("ROLLSERVE_SANDBOX_EGRESS_ALLOW")
    assert Settings().sandbox_egress_cap == ()
