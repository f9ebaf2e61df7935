"""One experiment: the daemon's own loop and a policy on a virtual clock against a simulated device and workload."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
from pydantic import BaseModel, ConfigDict

from governor.clock import VirtualClock
from governor.lab.device import DeviceSpec
from governor.lab.twins import SimulatedDevice, SimulatedEngine, actuators
from governor.lab.workload import WorkloadSpec
from governor.lab.world import Series, World
from governor.loop import Decider, GovernorLoop
from policies.decision import Decision
from sensors.snapshot import EngineObservation, Snapshot, TraceRecord

MODEL_CHANGE_GAP_S = 300.0  # a model switch at most once per 5 minutes (issue 27), unless a kill is imminent


class Summary(BaseModel):
    model_config = ConfigDict(frozen=True)

    device: str
    policy: str
    workload: str
    minutes: float
    tokens: float
    lost_tokens: float = 0.0  # of `tokens`, those of answers killed mid-stream (streamed, then an error)
    answers: int
    failed: int
    mean_tokens_per_s: float | None
    p10_tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    limit_zone: str
    trip_c: float
    peak_c: float
    mean_c: float
    peak_die_c: float
    throttled_pct: float
    state_changes: int
    config_changes: int  # ticks whose engine config (threads, context, KV, model, rate) differed from the last
    state_config_changes: int  # state changes that also changed the engine config (reconfiguration churn)
    model_changes: int = 0  # of config_changes, those that changed the model tier
    model_changes_within_5min: int = 0  # model changes less than 5 minutes after the previous one (issue 27: at most
    # one per 5 minutes unless a kill is imminent)
    state_pct: dict[str, float]  # share of the run spent in each state
    energy_j: float
    j_per_token: float | None
    oom_kills: int
    engine_starts: int  # engine processes started (the first, after an OOM kill, after waiting for memory)
    memory_wait_s: float  # time the engine was stopped because nothing fitted in memory
    wait_reason: str | None  # the first "no tier fits ..." the decisions said, as `governor status` would show it
    battery_used_wh: float | None
    battery_used_pct: float | None
    routed_answers: int = 0  # answered by the workload's upstream (issue 12); counted in answers and tokens too
    routed_tokens: float = 0.0
    restarts: int = 0  # llama-server restarted to change a setting (its slot restored in `restores` of them)
    restores: int = 0
    shutdown_s: float | None = None  # the kernel powered the device off at a critical trip then (off for the rest)


@dataclass
class Run:
    summary: Summary
    series: Series
    states: list[tuple[float, str]] = field(default_factory=list)  # (t, state) at every state change
    ticks: int = 0  # loop ticks (policy decisions) in the run


def weighted_percentile(samples: Sequence[tuple[float, float]], q: float) -> float | None:
    """The value below which a fraction q of the total weight lies (time-weighted rates)."""
    if not samples:
        return None
    arr = np.array(samples)
    order = np.argsort(arr[:, 0])
    values, weights = arr[order, 0], np.cumsum(arr[order, 1])
    return float(values[np.searchsorted(weights, q * weights[-1])])


def simulate(
    device: DeviceSpec,
    decider: Decider,
    workload: WorkloadSpec,
    *,
    policy_name: str,
    minutes: float | None = None,
    seed: int | None = None,
    trace: TextIO | None = None,
) -> Run:
    """Run `decider` in the daemon's GovernorLoop on a VirtualClock; `trace` gets one TraceRecord line per tick."""
    end_s = minutes * 60 if minutes is not None else workload.duration_s
    clock = VirtualClock()
    world = World(device, workload, seed, policy=getattr(decider, "policy", None))
    stop = threading.Event()
    states: list[tuple[float, str]] = []
    ticks = 0
    changes = [0, 0, 0, 0]  # config changes, of which at a state change, of the model, of the model within 5 min
    model_t = [-float("inf")]  # when the model last changed
    waits: list[str] = []
    last: list[Decision] = []

    def listen(t: float, snapshot: Snapshot, observed: EngineObservation | None, decision: Decision) -> None:
        nonlocal ticks
        ticks += 1
        if trace is not None:
            record = TraceRecord(**dict(snapshot), t=t, engine=observed)
            trace.write(record.model_dump_json(exclude_defaults=True) + "\n")
        if last and decision.engine != last[0].engine and world.off_s is None:  # (off: the daemon is too)
            changes[0] += 1
            changes[1] += decision.state != last[0].state
            if decision.engine.model != last[0].engine.model:
                changes[2] += 1
                # sooner than 5 minutes, unless the decision records that the model in force would be killed
                changes[3] += t - model_t[0] < MODEL_CHANGE_GAP_S and not decision.readings.get("switch_kill")
                model_t[0] = t
        last[:] = [decision]
        if decision.engine_wait is not None and not waits:
            waits.append(decision.engine_wait)
        if not states or states[-1][1] != decision.state.value:
            states.append((t, decision.state.value))
        if t >= end_s:
            stop.set()
            loop.wake.set()

    sensors, engine = SimulatedDevice(world, clock), SimulatedEngine(world, clock)
    listeners = [world.on_tick, listen]
    loop = GovernorLoop(sensors, decider, engine, clock, actuators=actuators(world, engine), listeners=listeners)
    for event in workload.event:
        if event.plugged is not None:  # a power_supply uevent: the daemon ticks at once (udev), so does the lab
            clock.call_at(event.at_s, loop.wake.set)
    # The last tick at the end, not a calm interval after it: every run is measured over the same span (a 5 s calm
    # wait past the end once charged one policy ~3 J of idle power that `none`, ticking each second, did not pay).
    clock.call_at(end_s, loop.wake.set)
    loop.run(stop)
    summary = summarize(
        world, policy_name, workload.name, states, changes=(changes[0], changes[1], changes[2], changes[3]),
        wait=waits[0] if waits else None,
    )  # fmt: skip
    return Run(summary=summary, series=world.series, states=states, ticks=ticks)


def time_in_states(states: Sequence[tuple[float, str]], end_s: float) -> dict[str, float]:
    """Percent of [first change, end_s] spent in each state, from the (t, state) change points."""
    spent: dict[str, float] = {}
    for (t, state), (t_next, _) in zip(states, [*states[1:], (end_s, "")], strict=True):
        spent[state] = spent.get(state, 0.0) + max(0.0, t_next - t)
    total = sum(spent.values())
    return {k: 100 * v / total for k, v in spent.items()} if total else {}


def summarize(
    world: World,
    policy: str,
    workload: str,
    states: Sequence[tuple[float, str]],
    changes: tuple[int, int, int, int] = (0, 0, 0, 0),
    *,
    wait: str | None = None,
) -> Summary:
    stats = world.engine.stats
    energy = world.thermal.energy_in_j
    bat = world.device.battery
    up = world.upstream
    routed_answers, routed_tokens = (up.answers, up.tokens) if up is not None else (0, 0.0)
    ttfts = stats.ttft_s + (up.ttft_s if up is not None else [])
    ttft = np.array(ttfts) if ttfts else None
    tokens = stats.tokens + routed_tokens
    return Summary(
        device=world.device.name,
        policy=policy,
        workload=workload,
        minutes=world.t / 60,
        tokens=round(tokens),
        lost_tokens=round(stats.lost_tokens),
        answers=stats.answers + routed_answers,
        failed=stats.failed,
        mean_tokens_per_s=stats.tokens / stats.decode_s if stats.decode_s else None,
        p10_tokens_per_s=weighted_percentile(stats.rate_samples, 0.10),
        ttft_p50_s=float(np.percentile(ttft, 50)) if ttft is not None else None,
        ttft_p95_s=float(np.percentile(ttft, 95)) if ttft is not None else None,
        limit_zone=world.device.zone[world.limit_index].label,
        trip_c=world.limit_trip.temp_c,
        peak_c=world.peak_limit_c,
        mean_c=world.sum_limit_c_s / world.t if world.t else world.peak_limit_c,
        peak_die_c=world.peak_die_c,
        throttled_pct=100 * world.throttled_s / world.t if world.t else 0.0,
        state_changes=max(0, len(states) - 1),
        config_changes=changes[0],
        state_config_changes=changes[1],
        model_changes=changes[2],
        model_changes_within_5min=changes[3],
        state_pct=time_in_states(states, world.t),
        energy_j=energy,
        j_per_token=energy / tokens if tokens else None,
        oom_kills=stats.oom_kills,
        engine_starts=stats.starts,
        restarts=stats.restarts,
        restores=stats.restores,
        memory_wait_s=world.wait_s,
        wait_reason=wait,
        battery_used_wh=world.battery_used_wh if bat else None,
        battery_used_pct=100 * world.battery_used_wh / bat.capacity_wh if bat else None,
        routed_answers=routed_answers,
        routed_tokens=round(routed_tokens),
        shutdown_s=world.off_s,
    )
