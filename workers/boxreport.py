"""Which box-wide limits a worker node's sandboxes get, told to the log and to the gateway.

A worker works the report out once (`sandbox.cgroups.enforced_limits` for its sandbox
backend: `memory`, `pids`, `cpu`, `disk`, `inodes`, each enforced or not, and how or why
not), logs it when it starts, and keeps it in Redis under `<prefix>sandbox-limits:<node>`,
written again with each reaper sweep and gone an hour after the last, so `GET /v1/stats`
shows it for every live node.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import redis

from sandbox.backends import get_backend
from sandbox.cgroups import LIMIT_NAMES, LimitSupport, enforced_limits

log = logging.getLogger(__name__)

REPORT_TTL_SECONDS = 3600
"""A node's report is dropped this long after its worker last wrote it."""

Report = dict[str, dict[str, Any]]
"""Limit name → `{"enforced": bool, "detail": str}`."""


def report_key(prefix: str, node: str) -> str:
    return f"{prefix}sandbox-limits:{node}"


@functools.cache
def node_report(backend: str) -> Report:
    """This host's report for boxes of `backend` (`auto`: the one `get_backend` picks)."""
    name = backend
    if backend == "auto":
        chosen = get_backend("auto")
        ok, why = chosen.available()
        if not ok:  # no backend makes boxes here: every job with tools fails, saying why
            return {limit: LimitSupport(False, why).as_dict() for limit in LIMIT_NAMES}
        name = chosen.name
    return {limit: support.as_dict() for limit, support in enforced_limits(name).items()}


def describe(report: Report) -> str:
    """One line for the log: `memory: enforced (how); disk: NOT enforced (why not); ...`."""
    parts = []
    for limit, support in report.items():
        state = "enforced" if support.get("enforced") else "NOT enforced"
        parts.append(f"{limit}: {state} ({support.get('detail', '')})")
    return "; ".join(parts)


def publish(client: redis.Redis, prefix: str, node: str, report: Report) -> None:
    """Keep `node`'s report where the gateway reads it, for `REPORT_TTL_SECONDS`."""
    client.set(report_key(prefix, node), json.dumps(report), ex=REPORT_TTL_SECONDS)


def read_reports(client: redis.Redis, prefix: str) -> dict[str, Report]:
    """Every live node's report, by node name."""
    reports: dict[str, Report] = {}
    start = report_key(prefix, "")
    for key in client.scan_iter(match=f"{start}*", count=200):
        name = key.decode() if isinstance(key, bytes) else str(key)
        raw = client.get(key)
        if raw is None:
            continue
        try:
            reports[name[len(start) :]] = json.loads(raw)
        except ValueError:
            continue
    return reports
