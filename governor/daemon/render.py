"""How `governor status` and `governor why` look in a terminal (rich tables); `--json` prints the raw answer."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from policies.decision import EngineConfig, HoldAsk

# C0 and C1 control characters and DEL: a terminal would act on them (escape sequences, title changes, clearing).
_CONTROL = dict.fromkeys([*range(32), 127, *range(128, 160)])


def printable(value: Any) -> str:
    """Text from the daemon with its control characters dropped, for a rich `Text` (which reads no markup)."""
    return str(value).translate(_CONTROL)


def safe(value: Any) -> str:
    """Text from the daemon (a reason, a hold's owner, a sensor path) as it is safe to print in a terminal through
    rich: control characters dropped, rich markup escaped ("[/]" would otherwise be a markup error or a style)."""
    return escape(printable(value))


def ago(wall: float | None, now: float) -> str:
    if wall is None:
        return "-"
    seconds = max(0.0, now - wall)
    when = time.strftime("%H:%M:%S", time.localtime(wall))
    if seconds < 120:
        return f"{when} ({seconds:.0f} s ago)"
    if seconds < 7200:
        return f"{when} ({seconds / 60:.0f} min ago)"
    return f"{when} ({seconds / 3600:.1f} h ago)"


def _settings(cfg: dict[str, Any]) -> str:
    """Engine settings from the daemon, as a reason shows them ("threads 2, n_ctx 512, KV f16, model m, ...")."""
    try:
        return safe(EngineConfig.model_validate(cfg).describe())
    except ValidationError:  # not the settings this client knows: show them as they came
        return safe(cfg)


def _activity(eng: dict[str, Any]) -> str:
    if eng.get("busy"):
        return "generating"
    return "unloaded (idle)" if eng.get("loaded") is False else "idle"


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return safe(f"{value}{unit}")


def _clock_row(head: Table, freq: dict[str, Any] | None) -> None:
    if freq:
        head.add_row("cpu clock", _clock(freq))


def _cap(c: dict[str, Any]) -> str:
    """One limit in force, in its own unit: a clock, intel_pstate's percentage or a RAPL package's watts."""
    name = safe(c["policy"])
    if c.get("unit") == "%":
        return f"{name} {c['cap_khz']} % of the top P-state"
    if c.get("unit") == "µW":
        return f"{name} ({safe(c.get('cpus'))}) {c['cap_khz'] / 1e6:.1f} of {c['max_khz'] / 1e6:.1f} W"
    return f"{name} {c['cap_khz'] / 1e6:.2f} of {c['max_khz'] / 1e6:.2f} GHz"


def _clock(freq: dict[str, Any]) -> str:
    """The frequency actuator: the caps in force per cluster, or why there are none."""
    capped = [c for c in freq.get("clusters") or [] if c.get("cap_khz")]
    if capped:
        clusters = ", ".join(_cap(c) for c in capped)
        return f"[yellow]capped[/]: {clusters} (restored on exit)"
    if freq.get("writable"):
        return "not capped (the governor may cap it when hot)"
    return f"[dim]{safe(freq.get('reason'))}[/]"


def _supervisor_says(sup: dict[str, Any]) -> str | None:
    """Given up, a crash story (while it restarts on safer settings), waiting for memory, or a memory cap."""
    if sup.get("waiting"):
        how = "paused (answer kept, model unloaded)" if sup.get("running") else "stopped"
        return f"[yellow]engine {how}: {safe(sup['waiting'])}[/]"
    if sup.get("critical"):
        return f"[red]given up: {safe(sup['critical'])}[/] (governor reload tries again)"
    if sup.get("crashes"):
        return f"[yellow]{safe(sup['crashes'])}[/]"
    if sup.get("cap"):
        cap_ = sup["cap"]
        return safe(f"capped at {cap_['model']}/n_ctx {cap_['n_ctx']}: {cap_['reason']}")
    return None


def _driver(driver: dict[str, Any]) -> str:
    """ "llama-server: changes live max_tokens_per_s; by a restart threads, n_ctx, ..." (what governs it, and how)."""
    parts = [f"{how} {', '.join(driver[key])}" for key, how in DRIVER_HOW if driver.get(key)]
    return safe(f"{driver.get('engine')}: " + "; ".join(parts or ["changes nothing"]))


DRIVER_HOW = (
    ("live", "changes live"),
    ("reload", "in place"),
    ("restart", "by a restart"),
    ("cannot", "cannot change"),
)


def status_table(status: dict[str, Any], console: Console, now: float | None = None) -> None:
    now = time.time() if now is None else now
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("state", f"[bold]{safe(status.get('state') or 'starting')}[/] since {ago(status.get('since'), now)}")
    head.add_row("why", safe(status.get("reason") or "-"))
    policy = status.get("policy") or {}
    head.add_row(
        "policy",
        safe(policy.get("name")) + (f"  [red]reload failed: {safe(policy['error'])}[/]" if policy.get("error") else ""),
    )
    cfg = status.get("config") or {}
    if cfg:
        head.add_row("engine config", _settings(cfg))
    _clock_row(head, (status.get("actuators") or {}).get("cpufreq"))
    eng = status.get("engine")
    sup = status.get("supervisor") or {}
    if eng:
        rss = eng.get("rss_bytes")
        head.add_row(
            "engine",
            f"{_activity(eng)}, {_fmt(eng.get('tokens_per_s'), ' tok/s')}, "
            f"RSS {'-' if rss is None else f'{rss / 2**20:.0f} MiB'}, pid {sup.get('pid')}",
        )
    else:
        retry = sup.get("retry_in_s")
        head.add_row(
            "engine",
            "[yellow]not answering[/]"
            + (f" ({safe(sup['last_exit'])})" if sup.get("last_exit") else "")
            + ("" if retry is None else f"; restarting in {retry:.0f} s"),
        )
    driver = ((status.get("actuators") or {}).get("engine") or {}).get("driver")
    if driver:
        head.add_row("engine kind", _driver(driver))
    said = _supervisor_says(sup)
    if said:
        head.add_row("supervisor", said)
    _routing_rows(head, status.get("routing"))
    for hold in status.get("holds") or []:
        asks = ", ".join(f"{k} {hold[k]}" for k in HoldAsk.model_fields if hold.get(k) is not None)
        ttl = hold.get("expires_in_s")
        left = "" if ttl is None else f", {ttl:g} s left"
        head.add_row(f"hold {hold['id']}", safe(f"{asks} by {hold['owner']}{left}"))
    console.print(head)

    readings = status.get("readings") or {}
    temps = Table(title="readings", title_justify="left", show_edge=False)
    for col in ("sensor", "label", "value", "trips"):
        temps.add_column(col)
    for t in readings.get("temperatures") or []:
        trips = ", ".join(f"{trip['type']} {trip['temp_c']:g}" for trip in t.get("trips") or [])
        temps.add_row(safe(t["source"]), safe(t["label"]), _fmt(t.get("temp_c"), " °C"), safe(trips or "-"))
    bat = readings.get("battery")
    if bat:
        plugged = {True: "plugged", False: "on battery", None: "power unknown"}[bat.get("plugged")]
        temps.add_row(safe(bat["source"]), "battery", _fmt(bat.get("percent"), " %", 0), plugged)
    mem = readings.get("memory") or {}
    if mem.get("available_bytes") is not None:
        psi = mem.get("psi_some_avg10")
        temps.add_row("memory", "available", f"{mem['available_bytes'] / 2**20:.0f} MiB", f"PSI some {_fmt(psi, ' %')}")
    cpu = readings.get("cpu") or {}
    if cpu.get("freq_ratio") is not None:
        temps.add_row("cpu", "freq ratio", _fmt(cpu["freq_ratio"], "", 2), "throttled" if cpu.get("throttled") else "")
    for problem in readings.get("problems") or []:
        temps.add_row(safe(problem["path"]), "[yellow]problem[/]", "", safe(problem["reason"]))
    console.print(temps)


def why_table(decisions: list[dict[str, Any]], console: Console) -> None:
    table = Table(show_edge=False)
    for col in ("at", "state", "engine", "why"):
        table.add_column(col, overflow="fold")
    for d in decisions:
        at = time.strftime("%H:%M:%S", time.localtime(d["wall"]))
        table.add_row(at, safe(d["state"]), _settings(d["engine"]), safe(d["reason"]))
    console.print(table)


def _routing_rows(head: Table, routing: dict[str, Any] | None) -> None:
    """Routing to upstreams (docs/routing.md): where requests go now and why, and each upstream's health. The API
    key is never in the status; only whether one is set."""
    if not routing or not routing.get("enabled"):
        return
    where = "[yellow]off the device[/]" if routing.get("off_device") else "on the device"
    slo = routing.get("slo") or {}
    targets = ", ".join(
        part
        for part in (
            f"≥ {slo['min_tokens_per_s']:g} tok/s" if slo.get("min_tokens_per_s") else "",
            f"TTFT ≤ {slo['max_ttft_s']:g} s" if slo.get("max_ttft_s") else "",
        )
        if part
    )
    head.add_row("routing", f"{where} ({safe(routing.get('reason'))}); targets {safe(targets or 'none')}")
    for up in routing.get("upstreams") or []:
        health = "healthy" if up.get("healthy") else f"[yellow]skipped[/] for {up.get('retry_in_s')} s"
        error = f"; last error {safe(up['last_error'])}" if up.get("last_error") else ""
        head.add_row(
            f"upstream {safe(up['name'])}",
            f"{safe(up['base_url'])}: {health}, {up.get('requests', 0)} requests, {up.get('errors', 0)} errors{error}",
        )
    last = (routing.get("last") or [])[-1:]
    for r in last:
        head.add_row("last request", f"{safe(r['route'])}: {safe(r['reason'])}")


def routes_table(routes: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="requests", title_justify="left", show_edge=False)
    for col in ("at", "route", "why"):
        table.add_column(col, overflow="fold")
    for r in routes:
        at = time.strftime("%H:%M:%S", time.localtime(r["wall"]))
        table.add_row(at, safe(r["route"]), safe(r["reason"]))
    console.print(table)
