"""`governor top`'s model and layout on made-up stream lines: any size fits, hostile text stays text."""

from __future__ import annotations

from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from governor.views.feed import Feed
from governor.views.top import TopView

NOW = 1_800_000_000.0


def line(t: int, temps: dict[str, float], state: str = "idle", label: str = "cpu-thermal") -> dict[str, Any]:
    readings: list[dict[str, Any]] = [
        {"source": "thermal_zone0", "kind": "thermal_zone", "label": label, "temp_c": temps.get("cpu"),
         "trips": [{"type": "passive", "temp_c": 80.0}, {"type": "critical", "temp_c": 105.0}]},
        {"source": "hwmon1/temp1", "kind": "hwmon", "label": "nvme", "temp_c": temps.get("nvme"),
         "trips": [{"type": "max", "temp_c": 70.0}]},
        {"source": "battery", "kind": "battery", "label": "BAT0", "temp_c": 30.0, "trips": []},
    ]  # fmt: skip
    status: dict[str, Any] = {
        "state": state, "since": NOW - 60, "reason": f"{state}: because", "policy": {"name": "/etc/p.toml"},
        "basis": {"zone": label, "temp_c": temps.get("cpu"), "trip_c": 80.0, "forecast_c": 50.0, "hot_enter_c": 75.0},
        "config": {"threads": 4, "n_ctx": 2048, "kv_type": "f16", "model": "large", "max_tokens_per_s": None,
                   "n_batch": 512},
        "engine": {"busy": True, "tokens_per_s": 12.5, "rss_bytes": 300 << 20},
        "readings": {"temperatures": [r for r in readings if r["temp_c"] is not None],
                     "memory": {"available_bytes": 2 << 30, "total_bytes": 4 << 30, "psi_some_avg10": 1.5},
                     "battery": None, "cpu": {"freq_ratio": 0.8}},
        "holds": [{"id": 3, "state": "idle", "owner": "pid 9 uid 0", "expires_in_s": 30.0}],
        "supervisor": {}, "actuators": {"cpufreq": {"writable": True, "clusters": []}},
    }  # fmt: skip
    decision = {"wall": NOW - 100 + t, "t": float(t), "state": state, "reason": f"{state}: decided at {t}"}
    return {"wall": NOW - 100 + t, "status": status, "decisions": [decision]}


def test_series_stay_aligned_when_a_sensor_comes_and_goes() -> None:
    feed = Feed(keep=10)
    feed.start(line(0, {"cpu": 50.0}) | {"routes": []})
    feed.add(line(1, {"cpu": 51.0, "nvme": 40.0}))
    feed.add(line(2, {"cpu": 52.0}))
    assert list(feed.temps["thermal_zone0"]) == [50.0, 51.0, 52.0]
    assert list(feed.temps["hwmon1/temp1"]) == [None, 40.0, None]
    assert "battery" not in feed.temps, "nothing throttles on it: no graph"
    assert feed.zones["hwmon1/temp1"].trip_c == 70.0
    assert feed.binding() == feed.zones["thermal_zone0"]
    for t in range(3, 30):
        feed.add(line(t, {"cpu": 60.0}))
    assert len(feed.temps["thermal_zone0"]) == 10
    assert len(feed.states) == 10


@pytest.mark.parametrize(("width", "height"), [(40, 12), (80, 24), (120, 40), (200, 50), (300, 80)])
def test_every_frame_fits_its_terminal(width: int, height: int) -> None:
    feed = Feed()
    feed.start(line(0, {"cpu": 50.0, "nvme": 40.0}))
    for t in range(1, 60):
        feed.add(line(t, {"cpu": 50.0 + t, "nvme": 40.0}, "hot" if t > 30 else "sustained"))
    lines = TopView(feed).lines(width, height, NOW)
    assert len(lines) <= height
    assert max(cell_len(x.plain) for x in lines) <= width
    text = "\n".join(x.plain for x in lines)
    assert "HOT" in lines[0].plain
    assert "nvme" in text, "the other sensor with a trip, as a sparkline"
    assert "#3 state idle (pid 9 uid 0, 30 s left)" in text or width < 80


def test_text_from_the_daemon_stays_text() -> None:
    """A sensor label or a reason with escape sequences or rich markup is shown, never acted on."""
    feed = Feed()
    hostile = "evil\x1b]0;pwned\x07[bold red]x[/]"
    feed.start(line(0, {"cpu": 50.0}, label=hostile))
    console = Console(width=120, height=30, force_terminal=True, color_system="truecolor")
    with console.capture() as captured:
        console.print(TopView(feed).frame(120, 30, NOW))
    out = captured.get()
    assert "\x07" not in out
    assert "]0;pwned" in out, "printed, without the escape that would have made it a title"
    assert "[bold red]x[/]" in out
