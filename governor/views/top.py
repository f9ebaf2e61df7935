"""`governor top`: a live terminal view of the governor, fed by the daemon's `watch` stream.

The frame is a list of lines cut to the terminal's size (80x24 at least, larger shows longer graphs and more
decisions). Every graph reads without colour: bars for the temperature with the trip drawn as a dashed row, one
letter per sample for the state; colour (where the terminal has it) only repeats what the glyphs say.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from governor.daemon.client import ControlClient
from governor.daemon.control import ControlError
from governor.daemon.render import ago, printable, safe
from governor.views.feed import Feed
from policies.decision import EngineConfig, HoldAsk

BLOCKS = " ▁▂▃▄▅▆▇█"
STATE_MARK = {"idle": "i", "sustained": "s", "hot": "H", "low_battery": "b", "critical": "C"}
STATE_STYLE = {
    "idle": "green", "sustained": "cyan", "hot": "bold red", "low_battery": "yellow", "critical": "bold magenta"
}  # fmt: skip
AXIS_W = 7  # "  80.0┤"
RECONNECT_S = 2.0
AGE_REFRESH_S = (
    5.0  # with nothing new, the frame is redrawn this often (its "updated N s ago"): rich draws a frame in ~10 ms
)
MIB = 1 << 20


def _clip(text: Text, width: int) -> Text:
    text = text.copy()
    text.truncate(width, overflow="ellipsis")
    return text


def _temp_style(value: float, trip: float | None) -> str:
    if trip is None:
        return "green"
    if value >= trip:
        return "red"
    return "yellow" if value >= trip - 10 else "green"


def _bars(vals: Sequence[float | None], size: tuple[int, int], lo: float, hi: float, trip: float | None) -> list[Text]:
    """A bar per sample, newest at the right, `size` (width, height); the trip's row dashed where no bar is."""
    width, height = size
    pad: list[float | None] = [None] * max(0, width - len(vals))
    cols = pad + list(vals)[-width:]
    span = max(hi - lo, 1e-9)
    trip_row = None if trip is None else min(height - 1, max(0, int((trip - lo) / span * height)))
    rows: list[Text] = []
    for r in range(height - 1, -1, -1):  # top row first
        row = Text()
        for v in cols:
            if v is None or not math.isfinite(v):
                glyph, style = ("╌" if r == trip_row else " "), "dim red"
            else:
                eighths = round((v - lo) / span * height * 8) - r * 8
                glyph = BLOCKS[max(0, min(8, eighths))]
                style = _temp_style(v, trip)
                if glyph == " " and r == trip_row:
                    glyph, style = "╌", "dim red"
            row.append(glyph, style)
        rows.append(row)
    return rows


def _spark(values: Sequence[float | None], width: int, lo: float, hi: float) -> Text:
    cols = list(values)[-width:]
    out = Text(" " * (width - len(cols)))
    span = max(hi - lo, 1e-9)
    for v in cols:
        if v is None or not math.isfinite(v):
            out.append(" ")
        else:
            out.append(BLOCKS[max(1, min(8, round((v - lo) / span * 8)))], "cyan")
    return out


def _c(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class TopView:
    """Lays out one frame from a Feed."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def lines(self, width: int, height: int, now: float, note: str = "") -> list[Text]:
        f = self.feed
        st = f.status
        width, height = max(width, 40), max(height, 12)
        head = self._header(st, width, now, note)
        why = Text.assemble(("why  ", "bold"), printable(st.get("reason") or "-"))
        why_lines = why.wrap(Console(width=width, color_system=None), width)[: 3 if height >= 40 else 2]
        below = self._below(st, width, now)
        decisions = self._decisions(width)
        fixed = 1 + len(why_lines) + 1 + 1 + len(below) + 1  # header, why, zone title, state band, ..., "decisions"
        room = height - fixed
        chart_h = max(3, min(16, room // 2 if height < 40 else room - 16))
        zone_lines = self._zones(width, chart_h)
        out = [head, *why_lines, *zone_lines, self._band(width), *below]
        out.append(Text.assemble(("decisions", "bold"), (f" (newest first; {len(f.decisions)} kept)", "dim")))
        out += decisions[: max(0, height - len(out))]
        return [_clip(line, width) for line in out[:height]]

    def _header(self, st: dict[str, Any], width: int, now: float, note: str) -> Text:
        state = st.get("state") or "starting"
        policy = (st.get("policy") or {}).get("name")
        left = Text.assemble(
            ("governor ", "bold"),
            (f" {state.upper()} ", f"reverse {STATE_STYLE.get(state, '')}"),
            f" since {ago(st.get('since'), now)}  policy {printable(os.path.basename(str(policy or '-')))}",
        )
        right = note or (f"updated {max(0.0, now - self.feed.wall):.0f} s ago" if self.feed.wall else "")
        gap = width - left.cell_len - len(right)
        return Text.assemble(left, " " * max(1, gap), (right, "dim"))

    def _zones(self, width: int, chart_h: int) -> list[Text]:
        f = self.feed
        basis = f.status.get("basis") or {}
        zone = f.binding()
        if zone is None:
            return [Text("temperature  no zone with a trip", "dim"), *[Text("")] * (chart_h)]
        values = list(f.temps.get(zone.source) or [])
        trip = basis.get("trip_c") if basis.get("zone") == zone.label else zone.trip_c
        latest = next((v for v in reversed(values) if v is not None), None)
        title = Text.assemble((printable(zone.label), "bold"), f"  {_c(latest)} °C  trip {_c(trip, 0)} °C")
        if basis.get("forecast_c") is not None and basis.get("zone") == zone.label:
            title += Text(f"  forecast {_c(basis['forecast_c'])} °C")
        if basis.get("hot_enter_c") is not None and basis.get("zone") == zone.label:
            title += Text(f"  hot at {_c(basis['hot_enter_c'])} °C", "dim")
        finite = [v for v in values if v is not None and math.isfinite(v)]
        top = max([*finite, trip or 0.0, *(v for v in [basis.get("forecast_c")] if v is not None)]) + 2
        low = min([*finite, (trip or top) - 30]) - 2
        lo, hi = math.floor(low / 5) * 5, math.ceil(top / 5) * 5
        rows = _bars(values, (width - AXIS_W, chart_h), lo, hi, trip)
        out = [title]
        for i, row in enumerate(rows):
            r = chart_h - 1 - i
            mark = hi if i == 0 else lo if r == 0 else None
            trip_row = None if trip is None else min(chart_h - 1, max(0, int((trip - lo) / (hi - lo) * chart_h)))
            if r == trip_row:
                mark = trip
            axis = f"{mark:5.0f} ┤" if mark is not None else "      │"
            out.append(Text(axis, "dim") + row)
        for other in f.zones.values():
            if other is zone:
                continue
            series = list(f.temps.get(other.source) or [])
            last = next((v for v in reversed(series) if v is not None), None)
            label = f"{printable(other.label)[:14]:<14} {_c(last):>5} °C trip {_c(other.trip_c, 0):>3} "
            spark_lo = min([v for v in series if v is not None] + [(other.trip_c or 60.0) - 30])
            out.append(Text(label) + _spark(series, width - len(label), spark_lo, other.trip_c or spark_lo + 30))
        return out

    def _band(self, width: int) -> Text:
        states = list(self.feed.states)[-(width - AXIS_W) :]
        band = Text.assemble(("state │", "dim"), " " * (width - AXIS_W - len(states)))
        for s in states:
            band.append(STATE_MARK.get(s or "", "?"), STATE_STYLE.get(s or "", ""))
        return band

    def _below(self, st: dict[str, Any], width: int, now: float) -> list[Text]:
        f = self.feed
        cfg = st.get("config") or {}
        eng = st.get("engine") or {}
        out: list[Text] = []
        rate = eng.get("tokens_per_s")
        cap = cfg.get("max_tokens_per_s")
        label = f"tok/s {_c(rate):>5} "
        tail = (f" cap {cap:g}" if cap else " no cap") + f" · {self._activity(st)}"
        finite = [v for v in f.tokens if v is not None]
        spark = _spark(f.tokens, max(10, width - len(label) - len(tail)), 0.0, max([*finite, cap or 0.0, 1.0]))
        out.append(Text.assemble((label, "bold"), spark, (tail, "dim")))
        out.append(Text.assemble(("knobs ", "bold"), self._engine(st)))
        out.append(Text.assemble(("clock  ", "bold"), Text.from_markup(self._clock(st))))
        out.append(Text.assemble(("memory ", "bold"), self._memory(st)))
        out.append(Text.assemble(("holds  ", "bold"), self._holds(st)))
        routing = st.get("routing") or {}
        if routing.get("enabled"):
            where = "off the device" if routing.get("off_device") else "on the device"
            out.append(Text.assemble(("route  ", "bold"), printable(f"{where}: {routing.get('reason')}")))
        return out

    @staticmethod
    def _engine(st: dict[str, Any]) -> str:
        cfg = st.get("config") or {}
        try:
            return printable(EngineConfig.model_validate(cfg).describe() if cfg else "no decision yet")
        except ValueError:
            return printable(cfg)

    @staticmethod
    def _activity(st: dict[str, Any]) -> str:
        eng, sup = st.get("engine") or {}, st.get("supervisor") or {}
        if sup.get("critical"):
            return printable(f"given up: {sup['critical']}")
        if sup.get("waiting"):
            return printable(f"waiting: {sup['waiting']}")
        if not eng:
            return printable("not answering" + (f" ({sup['last_exit']})" if sup.get("last_exit") else ""))
        activity = "generating" if eng.get("busy") else "unloaded (idle)" if eng.get("loaded") is False else "idle"
        rss = eng.get("rss_bytes")
        return activity + (f" · RSS {rss / MIB:.0f} MiB" if rss else "")

    @staticmethod
    def _clock(st: dict[str, Any]) -> str:
        freq = (st.get("actuators") or {}).get("cpufreq") or {}
        capped = [c for c in freq.get("clusters") or [] if c.get("cap_khz")]
        if capped:
            return "[yellow]capped[/] " + ", ".join(
                safe(f"{c['policy']} {c['cap_khz'] / 1e6:.2f}/{c['max_khz'] / 1e6:.2f} GHz")
                if c.get("unit") not in ("%", "µW")
                else safe(f"{c['policy']} {c['cap_khz']} of {c['max_khz']} {c['unit']}")
                for c in capped
            )
        ratio = ((st.get("readings") or {}).get("cpu") or {}).get("freq_ratio")
        now = "" if ratio is None else f"running at {ratio:.0%} of max; "
        if freq.get("writable"):
            return safe(f"{now}not capped")
        return safe(f"{now}not capped (not writable here)")

    @staticmethod
    def _memory(st: dict[str, Any]) -> str:
        readings = st.get("readings") or {}
        mem = readings.get("memory") or {}
        parts = []
        if mem.get("available_bytes") is not None:
            total = mem.get("total_bytes")
            of = f" of {total / 2**30:.1f}" if total else ""
            psi = mem.get("psi_some_avg10")
            parts.append(f"{mem['available_bytes'] / 2**30:.1f}{of} GiB free, PSI {_c(psi)} %")
        bat = readings.get("battery")
        if bat:
            how = "charging" if bat.get("charging") else "on mains" if bat.get("plugged") else "discharging"
            power = f", {bat['power_w']:.1f} W" if bat.get("power_w") is not None else ""
            parts.append(f"battery {_c(bat.get('percent'), 0)} % {how}{power}")
        return printable(" · ".join(parts) or "-")

    @staticmethod
    def _holds(st: dict[str, Any]) -> str:
        holds = st.get("holds") or []
        if not holds:
            return "none"
        parts = []
        for h in holds:
            asks = ", ".join(f"{k} {h[k]}" for k in HoldAsk.model_fields if h.get(k) is not None)
            left = "" if h.get("expires_in_s") is None else f", {h['expires_in_s']:g} s left"
            parts.append(f"#{h['id']} {asks} ({h.get('owner')}{left})")
        return printable("; ".join(parts))

    def _decisions(self, width: int) -> list[Text]:
        out = []
        for d in reversed(self.feed.decisions):
            at = time.strftime("%H:%M:%S", time.localtime(d["wall"]))
            state = str(d.get("state"))
            reason = printable(d.get("reason"))
            out.append(Text.assemble(f"{at} ", (f"{state:<11}", STATE_STYLE.get(state, "")), f" {reason}"))
        return out

    def frame(self, width: int, height: int, now: float, note: str = "") -> Group:
        return Group(*self.lines(width, height, now, note))


def _stream(client: ControlClient, feed: Feed, frames: int) -> None:
    """Read `frames` lines after the first answer into the feed (for a one-off frame: `--frames`)."""
    with client.watch() as watch, selectors.DefaultSelector() as sel:
        feed.start(watch.first)
        sel.register(watch, selectors.EVENT_READ)
        while True:
            for line in watch.lines():
                feed.add(line)
            if feed.samples > frames:
                return
            sel.select()


def print_frames(client: ControlClient, frames: int, console: Console) -> None:
    feed = Feed()
    _stream(client, feed, frames)
    for line in TopView(feed).lines(console.width, console.height, time.time()):
        console.print(line, crop=True, soft_wrap=False)


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """stdin in cbreak mode (single keys, no echo) while the view runs; restored on the way out."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_live(client: ControlClient, console: Console) -> int:
    """Full screen until q, Esc or Ctrl-C. The daemon's lines drive the redraws (and a key, or the terminal's new
    size, at the next one); a slow timer only ages the "updated N s ago". A daemon that goes away is waited for
    (reconnecting every RECONNECT_S)."""
    feed = Feed()
    view = TopView(feed)
    note = ""
    watch = None
    with _keys() as keys, Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
        try:
            while True:
                if watch is None:
                    try:
                        watch = client.watch()
                        feed.start(watch.first)
                        for line in watch.lines():
                            feed.add(line)
                        note = ""
                    except ControlError as exc:
                        note = f"no governor: {exc}"[: console.width // 2]
                live.update(view.frame(console.width, console.height, time.time(), note), refresh=True)
                with selectors.DefaultSelector() as sel:
                    if watch is not None:
                        sel.register(watch, selectors.EVENT_READ, "watch")
                    if keys:
                        sel.register(sys.stdin, selectors.EVENT_READ, "keys")
                    ready = sel.select(timeout=AGE_REFRESH_S if watch is not None else RECONNECT_S)
                for key, _ in ready:
                    if key.data == "keys":
                        pressed = os.read(sys.stdin.fileno(), 16)
                        if pressed[:1] in (b"q", b"Q") or pressed == b"\x1b":  # Esc alone; an arrow key starts so too
                            return 0
                    elif watch is not None:
                        try:
                            for line in watch.lines():
                                feed.add(line)
                        except ControlError as exc:
                            watch.close()
                            watch, note = None, str(exc)[: console.width // 2]
        except KeyboardInterrupt:
            return 0
        finally:
            if watch is not None:
                watch.close()
