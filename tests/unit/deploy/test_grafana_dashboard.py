"""The Grafana dashboard (deploy/grafana/splitserve-dashboard.json): it parses, every query is
valid PromQL, and every series and label it queries is one the gateway and instances export."""

from __future__ import annotations

import json
import re

import pytest
from deploy_support import DEPLOY

promql = pytest.importorskip("promql_parser",
                             reason="promql-parser is not installed; it is in the dev extra")

DASHBOARD = DEPLOY / "grafana" / "splitserve-dashboard.json"

# The series splitserve exports: type and labels (with their values where they are a fixed set).
# Gateway series carry no instance labels; instance series carry instance_id and role.
INSTANCE = {"instance_id": None, "role": None}
SERIES = {
    "splitserve_requests_total": ("counter", {"status": {"ok", "error", "aborted", "rejected"}}),
    "splitserve_request_ttft_seconds": ("histogram", {}),
    "splitserve_request_tbt_seconds": ("histogram", {}),
    "splitserve_request_jct_seconds": ("histogram", {}),
    "splitserve_prompt_tokens_total": ("counter", {}),
    "splitserve_generation_tokens_total": ("counter", {}),
    "splitserve_instances": ("gauge", {"role": None}),
    "splitserve_flips_total": ("counter", {"direction": None}),
    "splitserve_queue_length": ("gauge", {**INSTANCE, "stage": {
        "prefill_waiting", "prefill_running", "transferring", "decode_waiting",
        "decode_running"}}),
    "splitserve_kv_blocks": ("gauge", {**INSTANCE, "state": {"free", "used", "cached"}}),
    "splitserve_prefix_cache_query_tokens_total": ("counter", INSTANCE),
    "splitserve_prefix_cache_hit_tokens_total": ("counter", INSTANCE),
    "splitserve_kv_transfer_blocks_total": ("counter", {**INSTANCE, "kind": {"read",
                                                                              "skipped"}}),
    "splitserve_kv_transfer_bytes_total": ("counter", INSTANCE),
    "splitserve_kv_transfer_seconds": ("histogram", INSTANCE),
    "splitserve_kv_transfer_failures_total": ("counter", INSTANCE),
    "splitserve_kv_leases_expired_total": ("counter", INSTANCE),
    "splitserve_length_predictions_total": ("counter", {**INSTANCE, "outcome": {
        "exact", "within_one", "miss"}}),
    "splitserve_kv_integrity_violations_total": ("counter", INSTANCE),
    "splitserve_busy_seconds_total": ("counter", INSTANCE),
}
# Labels Prometheus adds to every scraped series (the ServiceMonitor's target labels).
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint"}
# Grafana's variables, replaced by plausible values before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
                     "$namespace": ".*", "$instance_id": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target."""
    return [(panel["title"], target["expr"]) for panel in all_panels(dashboard()["panels"])
            for target in panel.get("targets", [])]


def substitute(expr: str) -> str:
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def base_series(name: str) -> tuple[str, set[str]]:
    """The exported series a selector reads, and the extra labels its suffix brings."""
    if name in SERIES:
        return name, set()
    for suffix, extra in (("_bucket", {"le"}), ("_sum", set()), ("_count", set())):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and SERIES.get(base, ("",))[0] == "histogram":
            return base, extra
    raise AssertionError(f"{name} is not a series splitserve exports")


def selectors_and_groupings(expr):
    """Every vector selector, and every label an aggregation groups by, in a parsed query."""
    selectors, groupings = [], []

    def visit(node):
        if isinstance(node, promql.VectorSelector):
            selectors.append(node)
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            groupings.append(list(node.modifier.labels))
        return True

    promql.walk(expr, visit)
    return selectors, groupings


def test_dashboard_parses_and_is_importable():
    board = dashboard()
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 36
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], f"panel {panel['title']!r} has no query"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_query_is_valid_promql_on_exported_series():
    used: set[str] = set()
    for title, expr in queries():
        try:
            parsed = promql.parse(substitute(expr))
        except ValueError as exc:
            pytest.fail(f"panel {title!r}: invalid PromQL {expr!r}: {exc}")
        selectors, groupings = selectors_and_groupings(parsed)
        assert selectors, f"panel {title!r} reads no series"
        labels_read: set[str] = set()
        for selector in selectors:
            base, extra = base_series(selector.name)
            used.add(base)
            kind, labels = SERIES[base]
            known = set(labels) | extra | TARGET_LABELS
            labels_read |= known
            for matcher in selector.matchers.matchers:
                if matcher.name == "__name__":
                    continue
                assert matcher.name in known, (
                    f"panel {title!r}: {base} has no label {matcher.name!r}")
                values = labels.get(matcher.name)
                if values:
                    wanted = set(matcher.value.split("|")) if "Re" in str(matcher.op) else {
                        matcher.value}
                    assert wanted <= values, (
                        f"panel {title!r}: {base}{{{matcher.name}}} is never {wanted - values}")
            if kind == "counter":
                assert base.endswith("_total")
        for labels in groupings:
            for label in labels:
                assert label in labels_read, f"panel {title!r}: grouping by unknown {label!r}"
    missing = set(SERIES) - used
    assert not missing, f"series no panel shows: {sorted(missing)}"


def test_counters_and_histograms_are_read_as_rates():
    """A counter or histogram bucket is only meaningful through rate()/increase(); reading it
    raw (except a total that should stay 0, such as integrity violations) is a mistake."""
    raw_ok = {"splitserve_kv_integrity_violations_total"}
    for title, expr in queries():
        for name in re.findall(r"\b(splitserve_[a-z_]+)\b", expr):
            base, _ = base_series(name)
            if SERIES[base][0] == "gauge" or base in raw_ok:
                continue
            assert re.search(rf"(rate|increase)\(\s*{name}\b", expr), (
                f"panel {title!r} reads {name} without rate() or increase()")


def test_latency_panels_show_p50_and_p99():
    by_title: dict[str, list[str]] = {}
    for title, expr in queries():
        by_title.setdefault(title, []).append(expr)
    for series in ("splitserve_request_ttft_seconds", "splitserve_request_tbt_seconds",
                   "splitserve_request_jct_seconds", "splitserve_kv_transfer_seconds"):
        exprs = [e for es in by_title.values() for e in es if f"{series}_bucket" in e]
        quantiles = {m for e in exprs for m in re.findall(r"histogram_quantile\((0\.\d+)", e)}
        assert quantiles == {"0.5", "0.99"}, (series, quantiles)
