"""Prometheus metrics for fleets: served on the control socket (`GET /metrics`) and/or a node_exporter textfile.

A private CollectorRegistry (not the global one), so several daemons in one test process never share series.

The textfile is written on a thread of its own, never on the loop's: a full or failing filesystem under it (ENOSPC,
EIO, a hung NFS mount) costs the file, never a tick, READY or a decision (issue 33). A failed write is logged once per
distinct error and shown in `governor status` (`metrics_textfile`), and tried again at the next interval.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_origin

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, write_to_textfile

from governor.clock import Wake
from policies.decision import KNOBS, Decision, EngineConfig, State
from sensors.snapshot import EngineObservation, Snapshot

TEXTFILE_EVERY_S = 5.0  # node_exporter reads the file at scrape time; rewriting it each tick buys nothing


_TEXT_SETTINGS = {  # name -> whether the setting is text (a label) rather than a number
    name: info.annotation is str or get_origin(info.annotation) is Literal
    for name, info in EngineConfig.model_fields.items()
}


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


class DaemonMetrics:
    def __init__(self, *, textfile: Path | None = None, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.state = Gauge("governor_state", "1 for the current state", ["state"], registry=r)
        # One gauge per engine setting the decision asks for: a number (NaN: none), or 1 for the value in force.
        self.settings = {
            name: Gauge(
                f"governor_engine_{name}",
                f"The engine setting {name}: {KNOBS[name].help}" + (" (1 for the value in force)" if text else ""),
                [name] if text else [],
                registry=r,
            )
            for name, text in _TEXT_SETTINGS.items()
        }
        self.tokens = Gauge("governor_engine_tokens_per_second", "Engine's recent decode rate", registry=r)
        self.rss = Gauge("governor_engine_rss_bytes", "Engine process resident memory", registry=r)
        self.busy = Gauge("governor_engine_busy", "1 while the engine is generating", registry=r)
        self.temp = Gauge("governor_temperature_celsius", "Temperature readings", ["source", "label"], registry=r)
        self.trip = Gauge(
            "governor_temperature_trip_celsius", "Each sensor's declared trips", ["source", "label", "type"], registry=r
        )
        self.freq = Gauge("governor_cpu_freq_ratio", "CPU clock now, as a share of its maximum", registry=r)
        self.freq_cap = Gauge(
            "governor_cpu_freq_cap_ratio",
            "The clock cap decided, as a share of each cluster's maximum (1: none)",
            registry=r,
        )
        self.battery = Gauge("governor_battery_percent", "Battery charge (NaN: no battery)", registry=r)
        self.plugged = Gauge("governor_battery_plugged", "1 on external power", registry=r)
        self.mem_avail = Gauge("governor_memory_available_bytes", "MemAvailable", registry=r)
        self.psi = Gauge("governor_memory_psi_some_avg10", "Memory pressure, PSI some avg10 (%)", registry=r)
        self.changes = Counter("governor_decision_changes", "Decisions that changed the engine config", registry=r)
        self.ticks = Counter("governor_ticks", "Loop ticks", registry=r)
        self.supervision = Gauge("governor_supervisor", "Engine supervision figures", ["figure"], registry=r)
        # Routing (docs/routing.md): where chat requests ran and why, upstream failures, latencies by route.
        self.requests = Counter(
            "governor_requests", "Chat requests by route (local, upstream) and reason", ["route", "reason"], registry=r
        )
        self.upstream_errors = Counter(
            "governor_upstream_errors", "Upstream failures by phase", ["upstream", "phase"], registry=r
        )
        buckets = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
        self.ttft = Histogram(
            "governor_request_ttft_seconds", "Time to first token by route", ["route"], buckets=buckets, registry=r
        )
        self.duration = Histogram(
            "governor_request_seconds", "Whole chat request by route", ["route"], buckets=buckets, registry=r
        )
        self._extra = extra
        self.textfile = textfile
        self._written_t = -math.inf
        self._last: tuple[Snapshot, EngineObservation | None, Decision] | None = None
        self._lock = threading.Lock()  # the textfile's writer and a control-socket scrape may update at once
        self.textfile_error: str | None = None
        self.textfile_failures = 0
        self._due = Wake()
        self._closing = False
        self._writer: threading.Thread | None = None

    def on_tick(self, t: float, snapshot: Snapshot, observed: EngineObservation | None, decision: Decision) -> None:
        """Counts, and keeps the tick for the gauges: they are set when read (a scrape, the textfile), not four
        times a second while mitigating for nobody."""
        if decision.changed:
            self.changes.inc()
        self.ticks.inc()
        self._last = (snapshot, observed, decision)
        if self.textfile is not None and t - self._written_t >= TEXTFILE_EVERY_S:
            self._written_t = t
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_when_due, name="metrics-textfile", daemon=True)
                self._writer.start()
            self._due.set()

    def _write_when_due(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closing:
                return
            self.write_textfile()

    def close(self) -> None:
        """Stop the writer (its last write finished); the daemon then removes the file."""
        self._closing = True
        self._due.set()
        if self._writer is not None:
            self._writer.join(5.0)

    def routed(self, route: str, reason: str) -> None:
        self.requests.labels(route, reason).inc()

    def upstream_error(self, upstream: str, phase: str) -> None:
        self.upstream_errors.labels(upstream, phase).inc()

    def latency(self, route: str, ttft_s: float | None, total_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.labels(route).observe(ttft_s)
        if total_s is not None:
            self.duration.labels(route).observe(total_s)

    def _update(self) -> None:
        if self._last is None:
            return
        snapshot, observed, decision = self._last
        for state in State:
            self.state.labels(state.value).set(1.0 if state == decision.state else 0.0)
        for name, value in decision.engine.model_dump().items():
            gauge = self.settings[name]
            if _TEXT_SETTINGS[name]:
                gauge.clear()
                gauge.labels(value).set(1)
            else:
                gauge.set(_nan(value))
        self.tokens.set(_nan(observed.tokens_per_s if observed else None))
        self.rss.set(_nan(observed.rss_bytes if observed else None))
        self.busy.set(_nan(float(observed.busy) if observed else None))
        self.temp.clear()
        self.trip.clear()
        for temp in snapshot.temperatures:
            if temp.temp_c is not None:
                self.temp.labels(temp.source, temp.label).set(temp.temp_c)
            for trip in temp.trips:
                self.trip.labels(temp.source, temp.label, trip.type).set(trip.temp_c)
        self.freq.set(_nan(snapshot.cpu.freq_ratio))
        self.freq_cap.set(1.0 if decision.freq_ratio is None else decision.freq_ratio)
        battery = snapshot.battery
        self.battery.set(_nan(battery.percent if battery else None))
        plugged = battery.plugged if battery else None
        self.plugged.set(_nan(None if plugged is None else float(plugged)))
        self.mem_avail.set(_nan(snapshot.memory.available_bytes))
        self.psi.set(_nan(snapshot.memory.psi_some_avg10))
        if self._extra is not None:
            for figure, value in self._extra().items():
                self.supervision.labels(figure).set(value)

    def text(self) -> str:
        with self._lock:
            self._update()
            return generate_latest(self.registry).decode()

    def write_textfile(self) -> None:
        if self.textfile is None:
            return
        try:
            self.textfile.parent.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._update()
                write_to_textfile(str(self.textfile), self.registry)  # atomic: a temp file renamed into place
        except OSError as exc:
            error = f"{self.textfile}: {exc.strerror or exc}"
            self.textfile_failures += 1
            if error != self.textfile_error:
                structlog.get_logger("governor.metrics").error("cannot write the metrics textfile", error=error)
            self.textfile_error = error
        else:
            if self.textfile_error is not None:
                structlog.get_logger("governor.metrics").info("metrics textfile written again", path=str(self.textfile))
            self.textfile_error = None

    def textfile_status(self) -> dict[str, Any] | None:
        if self.textfile is None:
            return None
        return {"path": str(self.textfile), "error": self.textfile_error, "failures": self.textfile_failures}
