"""grafana/governor.json: every query names a metric the daemon exports (its DaemonMetrics, as node_exporter's
textfile collector reads them), and the panels the fleet view needs are there."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from governor.daemon.metrics import DaemonMetrics
from policies.decision import Decision, EngineConfig, State
from sensors.snapshot import Battery, Cpu, EngineObservation, Snapshot, Temperature, Trip

DASHBOARD = Path(__file__).resolve().parents[3] / "grafana" / "governor.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
# Aggregations may put their `by (...)` before their argument: `sum by (instance) (x)`.
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    clauses, function calls, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    expr = re.sub(r"\boffset\s+\S+", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if match.group() not in KEYWORDS | AGGREGATIONS and not rest.startswith("("):
            names.add(match.group())
    return names


def exported() -> set[str]:
    """The sample names of a DaemonMetrics that has seen a tick, a routed request and an upstream error."""
    metrics = DaemonMetrics(extra=lambda: {"engine_starts": 1.0, "engine_given_up": 0.0})
    zone = Temperature(
        source="thermal_zone0", kind="thermal_zone", label="cpu-thermal", temp_c=71.5,
        trips=(Trip(type="passive", temp_c=80.0), Trip(type="critical", temp_c=105.0)),
    )  # fmt: skip
    snapshot = Snapshot(
        temperatures=(zone,),
        battery=Battery(percent=40.0, charging=False, plugged=False, power_w=3.0, temp_c=30.0, source="sysfs:BAT0"),
        cpu=Cpu(freq_ratio=0.75, throttled=False),
    )
    config = EngineConfig(threads=2, n_ctx=1024, model="large", max_tokens_per_s=20.0)
    decision = Decision(t=1.0, state=State.HOT, engine=config, rule="thermal.pi", freq_ratio=0.6, reason="hot")
    metrics.on_tick(1.0, snapshot, EngineObservation(busy=True, tokens_per_s=7.5), decision)
    metrics.routed("upstream:lan", "slo")
    metrics.latency("upstream:lan", 0.4, 2.0)
    metrics.upstream_error("lan", "connect")
    text = metrics.text()
    assert 'governor_temperature_trip_celsius{label="cpu-thermal",source="thermal_zone0",type="passive"} 80.0' in text
    assert "governor_cpu_freq_ratio 0.75" in text
    assert "governor_cpu_freq_cap_ratio 0.6" in text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) for every panel's target and the device variable's query (Grafana's
    `label_values(METRIC, LABEL)`, whose METRIC is a selector)."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    for v in dashboard["templating"]["list"]:
        selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", v["definition"])
        assert selector, v["definition"]
        out.append((f"variable {v['name']}", selector.group(1)))
    return out


def test_every_query_names_a_metric_the_daemon_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    unknown = [(title, name) for title, expr in queries(dashboard) for name in metric_names(expr) if name not in names]
    assert unknown == []
    used = set().union(*(metric_names(expr) for _, expr in queries(dashboard)))
    fleet = {
        "governor_temperature_celsius", "governor_temperature_trip_celsius", "governor_state",
        "governor_engine_tokens_per_second", "governor_cpu_freq_cap_ratio", "governor_requests_total",
        "governor_supervisor",
    }  # fmt: skip
    assert fleet <= used, "per device: temperature vs trip, state, tokens/s, clock cap, routed share, restarts"


def test_the_dashboard_imports_as_one(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        assert p["targets"], p["title"]
        assert {p["datasource"]["uid"], *(t["datasource"]["uid"] for t in p["targets"])} == {"${DS_PROMETHEUS}"}
        for target in p["targets"]:
            assert 'instance=~"$instance"' in target["expr"], f"{p['title']}: every query follows the device picker"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(governor_ticks_total{instance=~"$i"}[5m])', {"governor_ticks_total"}),
        ("sum by (instance, le) (rate(x_bucket[1m])) / ignoring(route) group_left y", {"x_bucket", "y"}),
        ('governor_temprature_celsius{label="a(b)"} > bool 3', {"governor_temprature_celsius"}),
        ("histogram_quantile(0.95, a) offset 5m", {"a"}),
    ],
)
def test_the_checker_reads_names_and_catches_a_typo(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
    assert not names <= exported() or names == {"governor_ticks_total"}
