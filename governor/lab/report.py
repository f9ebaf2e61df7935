"""Showing experiments: one summary, a comparison table (rich), and the plot (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from governor.lab.experiment import Run, Summary
from policies.decision import PRIORITY

STATE_ORDER = list(reversed([s.value for s in PRIORITY]))  # idle at the bottom of the plot, critical at the top


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def summary_lines(s: Summary) -> list[str]:
    bat = "-" if s.battery_used_pct is None else f"{s.battery_used_pct:.1f} % ({s.battery_used_wh:.2f} Wh)"
    return [
        f"{s.device} / {s.workload} / policy {s.policy}: {s.minutes:.1f} simulated minutes",
        f"tokens generated     {s.tokens:,.0f} in {s.answers} answers ({s.failed} failed)"
        + (f"; {s.routed_tokens:,.0f} in {s.routed_answers} by the upstream" if s.routed_answers else ""),
        f"tokens/s             mean {_num(s.mean_tokens_per_s, 2)}, p10 {_num(s.p10_tokens_per_s, 2)}",
        f"time to first token  p50 {_num(s.ttft_p50_s, 2)} s, p95 {_num(s.ttft_p95_s, 2)} s",
        f"temperature          {s.limit_zone}: peak {s.peak_c:.1f} °C, mean {s.mean_c:.1f} °C "
        f"(trip {s.trip_c:.1f} °C); die peak {s.peak_die_c:.1f} °C",
        f"kernel throttling    {s.throttled_pct:.1f} % of the time"
        + (f"; a zone at its critical trip: powered off at {s.shutdown_s:.0f} s" if s.shutdown_s is not None else ""),
        f"state changes        {s.state_changes}; time in "
        + ", ".join(f"{state} {pct:.0f} %" for state, pct in sorted(s.state_pct.items(), key=lambda kv: -kv[1])),
        f"energy               {s.energy_j:,.0f} J, {_num(s.j_per_token, 2)} J/token",
        f"OOM kills            {s.oom_kills}; engine starts {s.engine_starts}"
        + (f"; restarts to change settings {s.restarts} ({s.restores} slot restored)" if s.restarts else ""),
        f"waiting for memory   {s.memory_wait_s:.0f} s" + (f" ({s.wait_reason})" if s.wait_reason else ""),
        f"battery used         {bat}",
    ]


def comparison_table(runs: Sequence[Run], baseline: str = "none") -> Table:
    first = runs[0].summary
    base = next((r.summary for r in runs if r.summary.policy == baseline), None)
    table = Table(title=f"{first.device} / {first.workload}, {first.minutes:.0f} min (trip {first.trip_c:.0f} °C)")
    columns = [
        "policy", "tokens", f"÷ {baseline}", "tok/s", "p10", "TTFT p50", "TTFT p95", f"peak {first.limit_zone}",
        "mean °C", "throttled", "changes", "energy J", "J/token", "OOM", "failed", "starts", "battery", "off at",
    ]  # fmt: skip
    for c in columns:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for run in runs:
        s = run.summary
        ratio = f"{s.tokens / base.tokens:.2f}x" if base is not None and base.tokens else "-"
        table.add_row(
            s.policy, f"{s.tokens:,.0f}", ratio, _num(s.mean_tokens_per_s, 2), _num(s.p10_tokens_per_s, 2),
            _num(s.ttft_p50_s) + " s", _num(s.ttft_p95_s) + " s", f"{s.peak_c:.1f} °C", f"{s.mean_c:.1f}",
            f"{s.throttled_pct:.1f} %", str(s.state_changes), f"{s.energy_j:,.0f}", _num(s.j_per_token, 2),
            str(s.oom_kills), str(s.failed), str(s.engine_starts),
            "-" if s.battery_used_pct is None else f"{s.battery_used_pct:.1f} %",
            "-" if s.shutdown_s is None else f"{s.shutdown_s:.0f} s",
        )  # fmt: skip
    return table


def print_comparison(runs: Sequence[Run], console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)  # a pipe or a file: rich would squeeze the table into 80 columns
    console.print(comparison_table(runs))


@dataclass(frozen=True)
class PlotLine:
    """One run on the plot: the limiting zone's temperature and tokens/s over time, and the state changes."""

    label: str
    t_s: Sequence[float]
    temp_c: Sequence[float]
    tokens_per_s: Sequence[float]
    states: Sequence[tuple[float, str]]  # (t, state) at every change
    end_s: float


def plot(runs: Sequence[Run], path: Path) -> None:
    """Temperature (with the trip), state and tokens/s over time, one line per policy."""
    first = runs[0].summary
    lines = [
        PlotLine(s.policy, r.series.t, r.series.limit_c, r.series.tokens_per_s, r.states, 60 * s.minutes)
        for r in runs
        for s in [r.summary]
    ]
    draw(lines, path, title=f"{first.device} / {first.workload}", trip_c=first.trip_c, zone=first.limit_zone)


def draw(lines: Sequence[PlotLine], path: Path, *, title: str, trip_c: float | None, zone: str) -> None:
    """The lab's figure, for simulated runs and recorded traces alike (`governor plot`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s, ax_r) = plt.subplots(3, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1.5, 2])
    for i, line in enumerate(lines):
        color = f"C{i}"
        minutes = [t / 60 for t in line.t_s]
        ax_t.plot(minutes, line.temp_c, color=color, lw=1.2, label=line.label)
        ax_r.plot(minutes, _smooth(line.tokens_per_s, 5), color=color, lw=1.0)
        if line.states:
            xs = [t / 60 for t, _ in line.states] + [line.end_s / 60]
            ys = [STATE_ORDER.index(s) + 0.08 * (i - len(lines) / 2) for _, s in line.states]
            ax_s.step(xs, [*ys, ys[-1]], where="post", color=color, lw=1.2)
    if trip_c is not None:
        ax_t.axhline(trip_c, color="red", ls="--", lw=1, label=f"trip {trip_c:.0f} °C")
    ax_t.set_ylabel(f"{zone} °C")
    ax_t.legend(loc="lower right", fontsize=8)
    ax_t.set_title(title)
    ax_s.set_yticks(range(len(STATE_ORDER)), STATE_ORDER, fontsize=8)
    ax_s.set_ylabel("state")
    ax_r.set_ylabel("tokens/s")
    ax_r.set_xlabel("minutes")
    for ax in (ax_t, ax_s, ax_r):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _smooth(values: Sequence[float], n: int) -> list[float]:
    """A trailing mean over n samples: per-interval token counts are spiky between answers."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out
