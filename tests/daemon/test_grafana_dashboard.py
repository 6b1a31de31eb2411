"""The Grafana dashboard shipped in deploy/grafana/: valid JSON whose every PromQL expression
reads metrics route-serve exports, so a renamed metric breaks this test, not the dashboard."""

from __future__ import annotations

import json
import re

from fleetctl.daemon.telemetry import Counter, Histogram, RouterMetrics
from tests.conftest import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "fleetctl-autopilot.json"
# Metrics the autopilot and the warm-up-aware routing add to route-serve's /metrics, named
# here as they are specified until they are in its registry.
ADDED = {
    "fleetctl_backend_state",
    "fleetctl_backend_wakes_total",
    "fleetctl_autopilot_decisions_total",
    "fleetctl_autopilot_actions_total",
    "fleetctl_autopilot_forecast_requests",
    "fleetctl_autopilot_last_decision_timestamp_seconds",
}
NAME = re.compile(r"\bfleetctl_[a-zA-Z0-9_:]*")


def _registry() -> set[str]:
    """Every series name route-serve's registry can export (a histogram's three)."""
    names: set[str] = set()
    for metric in vars(RouterMetrics()).values():
        if isinstance(metric, Histogram):
            names |= {f"{metric.name}{s}" for s in ("_bucket", "_sum", "_count")}
        elif isinstance(metric, Counter):
            names.add(metric.name)
    return names


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_every_expression_reads_metrics_route_serve_exports():
    dash = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dash["panels"])
    assert len(exprs) >= 10
    known = _registry() | ADDED
    used: set[str] = set()
    for expr in exprs:
        names = set(NAME.findall(expr))
        assert names, f"an expression reads no fleetctl metric: {expr}"
        assert names <= known, f"{sorted(names - known)} in {expr}: not a route-serve metric"
        used |= names
    # What the dashboard is for: traffic and attainment per model, the objectives, the
    # servers' states and wakes, and the autopilot's decisions and actions.
    assert {
        "fleetctl_requests_total",
        "fleetctl_slo_requests_total",
        "fleetctl_slo_objective_seconds",
        "fleetctl_ttft_seconds_bucket",
        "fleetctl_tpot_seconds_bucket",
    } | ADDED <= used


def test_panels_have_titles_unique_ids_and_read_the_chosen_prometheus():
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model"} <= variables
    for p in panels:
        assert p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])
