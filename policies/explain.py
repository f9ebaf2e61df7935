"""Why: the rule that fired, the readings behind it and one sentence a user can read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from policies.allocator import Choice
from policies.authority import Aside
from policies.ceiling import RECENT_S as CYCLE_S
from policies.contention import ThreadsNote
from policies.decision import PRIORITY, EngineConfig, Readings, State
from policies.decision import readable as _n
from policies.memfit import MIB, Fit
from policies.readings import Sense, ThermalView
from policies.schema import Memory, Policy
from sensors.snapshot import EngineObservation

Clause = Callable[[], str]  # a part of the reason, formatted when the reason is read


class Tick(NamedTuple):
    """What one tick saw and chose; built by the state machine, read here (immutable, cheap to build)."""

    t: float
    policy: Policy
    sense: Sense
    previous_state: State
    state: State  # after the dwell gate
    label: State  # the state reported (a hold's pin can change it)
    desired: State  # what the conditions ask for
    held_for_s: float  # > 0: a change is waiting for the dwell
    prev: EngineConfig | None
    config: EngineConfig
    pi_u: float | None
    fit: Fit | None
    ramping: bool
    engine: EngineObservation | None
    capped: bool
    choice: Choice | None = None  # the power allocator's pick in hot / critical
    contention: ThreadsNote | None = None  # contention lowered the threads this tick
    load: Mapping[str, float | None] | None = None  # its readings
    sized_by: tuple[str, ...] = ()  # owners of the holds whose max_tier / max_ctx the config sits at
    declined: str | None = None  # a wanted change that waits for its price (policies/changecost.py)
    aside: Aside | None = None  # hot steps aside (policies/authority.py)
    ceiling: tuple[int, float] | None = None  # hot's threads at most, for this long (policies/ceiling.py)
    tier: tuple[str, float | None] | None = None  # hot's largest tier, the budget's share of ungoverned (tierstep.py)
    slow: tuple[int, ...] = ()  # hot's threads run on these CPUs, the slowest cluster alone (policies/hot.py)
    saturated: bool = False  # hot: others want every core (policies/contention.py `saturated`)


SATURATED = "others want every core: a thread or a rate cap the engine gives up goes to them, not off the die's watts"


def _headroom(v: ThermalView) -> str:
    """The binding zone against its own trip, e.g. "skin-therm 41.8 °C, 1.2 °C under its 43 °C trip"."""
    if v.temp_c is None:
        return "temperature unknown"
    room = v.trip_c - v.temp_c
    side = "under" if room >= 0 else "over"
    return f"{v.zone} {v.temp_c:.1f} °C, {abs(room):.1f} °C {side} its {_n(v.trip_c)} °C trip"


def _level(pct: float | None) -> str:
    return "unknown" if pct is None else f"{pct:.0f} %"


def _why_on(k: Tick, state: State) -> tuple[str, Clause]:
    """(rule, clause) for a state's condition being true; the clause is formatted when the reason is read."""
    sense, v, pol = k.sense, k.sense.view, k.policy
    pct = sense.battery.percent if sense.battery is not None else None
    if state == State.CRITICAL:
        given_up, crit_c, available = sense.given_up, v.critical_temp_c, sense.available
        if given_up is not None:
            return "supervisor.given_up", lambda: given_up
        if sense.crit_thermal and crit_c is not None:
            return "thermal.critical", lambda: f"{v.critical_zone} {crit_c:.1f} °C ≥ critical {_n(v.critical_c)} °C"
        if sense.crit_battery and pct is not None:
            return (
                "battery.critical",
                lambda: f"battery {_level(pct)} ≤ {_n(pol.battery.critical_percent)} % on battery power",
            )
        if sense.crit_memory and available is not None:
            return "memory.floor", lambda: f"{available / MIB:.0f} MiB available < floor {_n(pol.memory.floor_mb)} MiB"
        return "critical.hold", lambda: "critical conditions still debouncing"
    if state == State.HOT:
        temp, forecast = v.temp_c, sense.forecast_c
        if sense.untrusted:
            return "thermal.untrusted", lambda: "no trustworthy temperature (every trusted zone unreadable or absurd)"
        if temp is None or forecast is None:
            return "thermal.unknown", lambda: "temperature unknown, staying hot"
        if temp < v.hot_enter_c <= forecast:
            return (
                "thermal.forecast_enter",
                lambda: (
                    f"forecast {forecast:.1f} °C in {_n(pol.thermal.forecast_horizon_s)} s ≥ {_n(v.hot_enter_c)} °C "
                    f"({_headroom(v)})"
                ),
            )
        return "thermal.enter", lambda: f"{v.zone} {temp:.1f} °C ≥ {_n(v.hot_enter_c)} °C ({_headroom(v)})"
    if state == State.LOW_BATTERY:
        return "battery.low", lambda: f"battery {_level(pct)} ≤ {_n(pol.battery.low_percent)} % on battery power"
    act = pol.activity
    busy = sense.busy * 100
    if state == State.SUSTAINED:

        def sustained() -> str:
            if round(busy) >= round(act.enter_fraction * 100):
                return f"engine busy {busy:.0f} % of the last {_n(act.window_s)} s ≥ {act.enter_fraction * 100:.0f} %"
            # still on by hysteresis: never "22 % ≥ 50 %"
            exit_pct = act.exit_fraction * 100
            return f"engine busy {busy:.0f} % of the last {_n(act.window_s)} s, until below {exit_pct:.0f} %"

        return "activity.sustained", sustained
    return "activity.idle", lambda: f"engine busy {busy:.0f} % of the last {_n(act.window_s)} s"


def _why_off(k: Tick, state: State) -> tuple[str, Clause]:
    """(rule, clause) for a state's condition having ended."""
    v, pol = k.sense.view, k.policy
    pct = k.sense.battery.percent if k.sense.battery is not None else None
    if state == State.HOT:
        temp = v.temp_c
        return (
            "thermal.exit",
            lambda: (
                f"{v.zone or 'temperature'} {'unknown' if temp is None else f'{temp:.1f} °C'} < {_n(v.hot_exit_c)} °C"
            ),
        )
    if state == State.CRITICAL:
        return "critical.exit", lambda: "critical conditions cleared"
    if state == State.LOW_BATTERY:
        if k.sense.on_power:
            return "battery.plugged", lambda: f"on external power at {'unknown' if pct is None else f'{pct:.0f}'} %"
        above = pol.battery.low_percent + pol.battery.hysteresis_percent
        return "battery.recovered", lambda: f"battery {_level(pct)} > {_n(above)} %"
    act, busy = pol.activity, k.sense.busy * 100
    return (
        "activity.idle",
        lambda: f"engine busy {busy:.0f} % of the last {_n(act.window_s)} s < {act.exit_fraction * 100:.0f} %",
    )


def _changes(prev: EngineConfig | None, cfg: EngineConfig, always: bool) -> str:
    changes = "" if cfg is prev else cfg.describe(prev)  # the state machine reuses an unchanged config's object
    if not changes and always:
        return cfg.describe(live_only=True)
    return changes


def _pick(c: Choice) -> str:
    speed = "" if c.tok_s is None else f" ≈ {c.tok_s:.1f} tok/s"
    rate = "" if c.rate is None else f", rate cap {_n(c.rate)} tok/s"
    return f"{c.freq_ratio * 100:.0f} % clock x {c.threads} threads{speed} at ≈ {c.power_w:.1f} W{rate}"


def _allocation(c: Choice) -> str:
    """For example "power budget 5.1 W: 62 % clock x 4 threads ≈ 3.9 tok/s at ≈ 5.1 W (best with 3 threads: ...)"."""
    text = f"power budget {c.budget_w:.1f} W: {_pick(c)}"
    alt = c.alternative
    if alt is not None:
        speed = "" if alt.tok_s is None else f" ≈ {alt.tok_s:.1f} tok/s"
        text += f" (best with {alt.threads} threads: {alt.freq_ratio * 100:.0f} % clock{speed}, {alt.power_w:.1f} W)"
    return text


def rule_of(k: Tick) -> tuple[str, Clause]:
    """The rule that fired this tick and its clause: a transition, a wait, a hold, the PI, or why the state holds.
    Every tick needs the rule (the history keeps a decision when it changes); the clause, like the rest of the why,
    is formatted by `explain` when the reason is read."""
    v = k.sense.view
    if k.state != k.previous_state:
        escalating = PRIORITY.index(k.state) < PRIORITY.index(k.previous_state)
        return _why_on(k, k.state) if escalating else _why_off(k, k.previous_state)
    if k.held_for_s > 0:
        safer = PRIORITY.index(k.desired) < PRIORITY.index(k.state)
        why = _why_on(k, k.desired)[1] if safer else _why_off(k, k.state)[1]
        return "dwell.hold", lambda: f"{why()}, {k.desired.value} in {k.held_for_s:.1f} s (dwell)"
    if k.label != k.state:
        return "hold.pin", lambda: f"pinned by a client hold ({_why_on(k, k.state)[1]()})"
    if k.state == State.HOT and k.saturated and k.choice is None:
        return "thermal.saturated", lambda: f"{_headroom(v)}; pass-through: {SATURATED}; the kernel keeps the trip"
    if k.state == State.HOT and k.aside is not None:
        aside = k.aside
        if aside.kernel is not None:
            capped = k.config.max_tokens_per_s is not None
            return "thermal.kernel", lambda: _kernel(v, aside, capped)
        return "thermal.aside", lambda: _aside(v, aside.back_s)
    stepped = k.tier is not None and k.prev is not None and k.prev.model != k.config.model == k.tier[0]
    if k.state == State.HOT and stepped:
        return "thermal.tier", lambda: _tier(v, k)
    if k.state == State.HOT and k.pi_u is not None and v.temp_c is not None:
        u, ceiling = k.pi_u, k.ceiling
        if ceiling is not None:
            return (
                "thermal.ceiling",
                lambda: f"{_headroom(v)}, setpoint {_n(v.setpoint_c)} °C, PI output {u:.2f}; " + (_ceiling(ceiling)),
            )
        if k.slow:
            cpus = k.slow
            return (
                "thermal.slow_cores",
                lambda: (
                    f"{_headroom(v)}, setpoint {_n(v.setpoint_c)} °C, PI output {u:.2f}; threads on CPUs "
                    f"{_span(cpus)}, the slowest cores: more tokens within hot's power than on the fastest"
                ),
            )
        return "thermal.pi", lambda: f"{_headroom(v)}, setpoint {_n(v.setpoint_c)} °C, PI output {u:.2f}"
    rule, clause = _why_on(k, k.state)
    if k.fit is not None and k.fit.wait is not None:
        rule = "memory.wait"
    elif k.sense.untrusted and k.state == State.HOT:
        rule = "thermal.untrusted"
    elif k.declined is not None and k.config == k.prev:
        rule = "change.priced"
    elif k.sense.pressure:
        rule = "memory.pressure"
    elif k.contention is not None and k.prev is not None and k.config.threads != k.prev.threads:
        note = k.contention
        rule, clause = "cpu.contention", lambda: _contention(note)[0]
    elif k.ramping or (k.prev is not None and k.config.threads > k.prev.threads):
        rule = "recover.step"
    elif k.fit is not None and k.fit.bound != "profile" and k.prev is not None and k.config != k.prev:
        rule = "memory.fit"
    elif k.capped and k.prev is not None and k.config != k.prev:
        rule = "hold.cap"
    else:
        rule = f"state.{k.state.value}"
    return rule, clause


def _span(cpus: tuple[int, ...]) -> str:
    """CPUs as ranges, e.g. "2-7" or "0, 4-5"."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _ceiling(ceiling: tuple[int, float]) -> str:
    most, left = ceiling
    return (
        f"{_threads(most)} at most for {left:.0f} s more: hot had to cut {most + 1} again within "
        f"{CYCLE_S:.0f} s of coming back to them (no limit cycle)"
    )


def _tier(v: ThermalView, k: Tick) -> str:
    limit, share = k.tier or ("", None)
    prev = k.prev.model if k.prev is not None else "?"
    how = "" if share is None else f" at {share:.2f} x"
    return (
        f"{_headroom(v)}; hot's budget decodes {prev}{how} the ungoverned engine (every thread at the lowest clock, "
        f"the kernel's deepest throttling): {limit} at most, a smaller tier (more tokens per watt)"
    )


def _aside(v: ThermalView, back_s: float) -> str:
    return (
        f"{_headroom(v)}; pass-through: hot's cut at its floor did not bring the zone down and the kernel throttles "
        f"the clock anyway (the heat is not the engine's to govern); hot's limits return after {back_s:.0f} s "
        "without throttling"
    )


def _kernel(v: ThermalView, aside: Aside, capped: bool) -> str:
    governed, kernel = aside.kernel or (0.0, 0.0)
    over = "; over the trip, where the kernel's lowest clock does not hold it: a rate cap on every thread"
    clock = "the clock the kernel's throttling takes to keep the trip: more tokens per watt where it cannot be set"
    clock = "the lowest clock, over the trip: no smaller tier wins it back under it" if aside.over else clock
    return (
        f"{_headroom(v)}; pass-through: hot's limits {governed:.1f} tok/s vs {kernel:.1f} predicted ungoverned (every "
        f"thread at {clock}){over if capped else ''}; hot's limits return after {aside.back_s:.0f} s without throttling"
    )


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _contention(note: ThreadsNote) -> list[str]:
    """The load that capped the threads and/or the measurement that lowered them, as clauses of the reason."""
    out = []
    if note.cap is not None:
        use = "unknown" if note.other_cores is None else f"~{_n(round(note.other_cores, 1))}"
        psi = "" if note.psi is None else f" (CPU pressure {note.psi:.0f} %)"
        quiet = "" if note.quiet_s is None else f", quiet for {note.quiet_s:.0f} of {_n(note.dwell_s)} s"
        out.append(f"other processes use {use} of {note.count} cores{psi}{quiet}")
    if note.measured is not None and note.passthrough:
        chosen, rate, other, other_rate = note.measured
        out.append(
            f"pass-through: governed {other_rate:.1f} tok/s with {_threads(other)} vs {rate:.1f} measured ungoverned "
            f"({_threads(chosen)})"
        )
    elif note.measured is not None:
        chosen, rate, other, other_rate = note.measured
        out.append(f"{_threads(chosen)} measured {rate:.0f} tok/s vs {other_rate:.0f} with {other}")
    if note.probe is not None:
        tried, was, rate = note.probe
        what = f"the ungoverned {_threads(tried)}" if note.ungoverned_probe else _threads(tried)
        out.append(f"trying {what} for a few seconds ({_threads(was)} measured {rate:.0f} tok/s)")
    return out


def explain(k: Tick, fired: str, clause: Clause) -> tuple[str, Readings]:
    """The reason (the rule's clause, then what changed and why) and the readings, when someone asks: `rule_of(k)` gave
    `fired` and `clause` at the tick."""
    pol, v = k.policy, k.sense.view
    clauses = [clause()]
    changes = _changes(k.prev, k.config, always=k.state == State.HOT)
    if changes:
        clauses.append(changes)
    clauses += [f"capped at {k.config.model}/n_ctx {k.config.n_ctx} ({owner})" for owner in k.sized_by]
    if k.choice is not None:
        clauses.append(_allocation(k.choice) + (f"; {SATURATED}: the clock alone" if k.saturated else ""))
    if k.contention is not None:
        why = _contention(k.contention)
        if fired == "cpu.contention":
            clauses += why[1:]
        else:
            note = k.contention
            above = note.probe is not None or (note.measured is not None and note.measured[0] > note.measured[2])
            if note.passthrough or note.ungoverned_probe:
                clauses.append(", ".join(why))
            else:
                clauses.append(
                    f"{_threads(k.config.threads)} {'despite the load' if above else 'at most'}: {', '.join(why)}"
                )
    if k.ramping:
        clauses.append(f"threads come back one per {_n(pol.timing.recover_step_s)} s")
    if k.declined is not None:
        clauses.append(k.declined)
    if k.sense.pressure and k.sense.psi is not None:
        clauses.append(_pressure(k.sense.psi, pol.memory))
    if k.fit is not None:
        if k.fit.wait is not None:
            clauses.append(f"{k.fit.wait} ({k.fit.model} needs {k.fit.bytes / MIB:.0f} MiB at n_ctx {k.fit.n_ctx})")
        elif k.fit.bound != "profile":
            clauses.append(f"{k.fit.model} n_ctx {k.fit.n_ctx} KV {k.fit.kv_type} bound by {k.fit.bound}")
        clauses += [text for text in (k.fit.note, k.fit.kill if _switch_kill(k) else None) if text]
    if k.sense.cpu_throttled and k.state in {State.HOT, State.CRITICAL}:
        clauses.append("the CPU clock is already throttled by the kernel")
    unknown = []
    if v.temp_c is None:
        unknown.append("temperature")
    if k.sense.battery is not None and k.sense.battery.percent is None:
        unknown.append("battery level")
    if k.engine is None:
        unknown.append("engine activity")
    if k.fit is not None and k.sense.available is None:
        unknown.append("available memory")
    if unknown:
        clauses.append(f"{', '.join(unknown)} unknown")
    reason = f"{k.label.value}: {'; '.join(clauses)}"

    pct = k.sense.battery.percent if k.sense.battery is not None else None
    readings: Readings = {
        "temp_c": v.temp_c,
        "zone": v.zone,
        "forecast_c": None if k.sense.forecast_c is None else round(k.sense.forecast_c, 2),
        "hot_enter_c": v.hot_enter_c,
        "hot_exit_c": v.hot_exit_c,
        "setpoint_c": v.setpoint_c,
        "critical_c": v.critical_c,
        "trip_c": v.trip_c,
        "trip_source": v.trip_source,
        "headroom_c": None if v.headroom_c is None else round(v.headroom_c, 2),
        "battery_percent": pct,
        "on_power": k.sense.on_power if k.sense.battery is not None else None,
        "mem_available_mb": None if k.sense.available is None else round(k.sense.available / MIB, 1),
        "psi_some_avg10": k.sense.psi,
        "busy_fraction": round(k.sense.busy, 3),
        "pi_output": None if k.pi_u is None else round(k.pi_u, 3),
        "fit_bound": None if k.fit is None else k.fit.bound,
        "switch_kill": _switch_kill(k),
        "cpu_throttled": k.sense.cpu_throttled,
        "budget_w": None if k.choice is None else round(k.choice.budget_w, 2),
        "freq_ratio": None if k.choice is None else k.choice.freq_ratio,
        **(k.load or {}),
    }
    return reason, readings


def _switch_kill(k: Tick) -> bool | None:
    """This tick switches the model sooner than the model dwell because the model in force would be killed."""
    fit = k.fit
    return True if fit is not None and fit.kill and k.prev is not None and k.config.model != k.prev.model else None


def _pressure(psi: float, mem: Memory) -> str:
    if psi >= mem.psi_exit:
        return f"memory pressure {psi:.0f} % ≥ {_n(mem.psi_exit)} %, shrinking"
    # the exit is debounced: PSI must stay under psi_exit that long
    return (
        f"memory pressure {psi:.0f} % < {_n(mem.psi_exit)} %, the shrink holds until it has stayed below for"
        f" {_n(mem.psi_exit_debounce_s)} s"
    )
