"""deploy/grafana/rollserve.json: a well-formed Grafana dashboard whose every query asks for
series the gateway's /metrics actually exports, and that has a panel for each of them.

The exported names are scraped from a real gateway (on the test's Redis, with a backend
registered and a job submitted, so that every family has samples), not listed by hand."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, serve

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "rollserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# PromQL words that are not metric names: functions are told apart by the "(" after them.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "inf", "nan"}  # fmt: skip
LABEL_SETS = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring)\s*\([^)]*\)|\[[^\]]*\]")
NAMES = re.compile(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:]*\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, grouping labels, range
    durations, function names and keywords left out)."""
    stripped = LABEL_SETS.sub(" ", expr)
    return {name for name in NAMES.findall(stripped) if name.lower() not in KEYWORDS}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those nested in collapsed rows too."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture
def exported(redis_url: str) -> Iterator[dict[str, set[str]]]:
    """Per metric family the gateway exports, its sample names (`_bucket`, `_total`, ...)."""
    with (
        serve(create_app(Settings(redis_url=redis_url))) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        backend = {"url": "http://127.0.0.1:9", "model": "m", "id": "b0"}
        assert http.post("/v1/backends?verify=false", json=backend).status_code == 201
        assert http.post("/v1/rollouts", json={"task": GOOD_TASK}).status_code == 202
        text = http.get("/metrics").text
    yield {
        family.name: {sample.name for sample in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    all_panels = panels(dashboard)
    ids = [panel["id"] for panel in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    taken: set[tuple[int, int]] = set()
    for panel in all_panels:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}  # fmt: skip
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_every_query_asks_for_what_the_gateway_exports(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    samples = set().union(*exported.values())
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            names = metric_names(target["expr"])
            assert names, f"{panel['title']}: no metric in {target['expr']}"
            assert names <= samples, f"{panel['title']}: not exported: {names - samples}"


def test_every_exported_family_has_a_panel(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    asked = {
        name
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        for name in metric_names(target["expr"])
    }
    shown = {family for family, names in exported.items() if names & asked}
    assert shown == set(exported), f"no panel for {set(exported) - shown}"
    histogram = "rollserve_stage_duration_seconds_bucket"
    quantiles = [
        target["expr"]
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if "histogram_quantile" in target["expr"] and histogram in target["expr"]
    ]
    assert any("0.5," in expr for expr in quantiles) and any("0.95," in expr for expr in quantiles)


def test_the_name_reader_sees_metrics_not_labels_or_functions() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, stage) (rate(rollserve_x_bucket{stage="run"}[5m])))'
        " / clamp_min(sum(other_metric offset 5m), 1) and on (job) up"
    )
    assert metric_names(expr) == {"rollserve_x_bucket", "other_metric", "up"}
