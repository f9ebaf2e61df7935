"""A simulated device: the `World` that advances its physics lazily to the clock's time on a fixed grid, and the
snapshot its sensors give. The loop sees it through the daemon's parts' twins (governor/lab/twins.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from governor.lab.device import MB, DeviceSpec
from governor.lab.engine import EngineSim
from governor.lab.routing import UpstreamSim
from governor.lab.thermal import StepWise, ThermalModel
from governor.lab.workload import Driver, WorkloadSpec
from policies.decision import Decision
from policies.schema import Policy
from sensors.snapshot import Battery, Cluster, Cpu, EngineObservation, Memory, Snapshot, Temperature, Trip

PSI_KNEE = 0.10  # memory stalls start when less than this fraction of RAM is available
PSI_WINDOW_S = 10.0  # `some avg10` is a running average over 10 s (kernel/sched/psi.c: exponential, updated every 2 s)


@dataclass
class Series:
    """The run over time at `every_s` resolution, for plots."""

    t: list[float] = field(default_factory=list)
    limit_c: list[float] = field(default_factory=list)  # the limiting zone (die or skin)
    die_c: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)  # decoded tokens in the interval / interval
    freq_ratio: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)


class World:
    def __init__(
        self,
        device: DeviceSpec,
        workload: WorkloadSpec,
        seed: int | None = None,
        record_s: float = 2.0,
        policy: Policy | None = None,
    ):
        self.device = device
        # The workload's upstream, judged against the policy's [slo] (no upstream or no targets: all local).
        self.upstream = UpstreamSim(workload.upstream, policy) if workload.upstream is not None else None
        self.dt = device.sim.dt_s
        self.thermal = ThermalModel(device.thermal, device.ambient_c, start_power_w=device.power.idle_w)
        trips = []
        for i, zone in enumerate(device.zone):
            for trip in zone.trip:
                if trip.type == "passive":
                    deepest = len(device.cpu.freq_steps) - 1
                    trips.append((i, trip.temp_c, trip.hysteresis_c, min(trip.max_state or deepest, deepest)))
        self.kernel = StepWise(trips, len(device.zone))
        # A zone at its critical trip: the kernel powers the device off (drivers/thermal/thermal_core.c,
        # handle_critical_trips -> hw_protection_shutdown, "Temperature too high"); it stays off for the run.
        self._critical = [(i, t.temp_c) for i, z in enumerate(device.zone) for t in z.trip if t.type == "critical"]
        self.off_s: float | None = None  # powered off then
        self._poll_every = max(1, round(device.cpu.poll_s / self.dt))
        self._zone_die = [z.node == "die" for z in device.zone]
        self._trips = [tuple(Trip(type=t.type, temp_c=t.temp_c) for t in z.trip) for z in device.zone]
        self.limit_index, self.limit_trip = device.limit_zone()
        cpu = device.cpu
        big = cpu.cores - cpu.little_cores
        self._clusters = (  # what sysfs's cpu_capacity says of a big.LITTLE device, big first (sensors.cpu)
            (
                Cluster(cpus=tuple(range(big)), capacity=1.0),
                Cluster(cpus=tuple(range(big, cpu.cores)), capacity=cpu.little_speed),
            )
            if cpu.little_cores
            else ()
        )
        self.engine = EngineSim(device.engine, device.cpu)
        self.driver = Driver(workload, seed)
        self.other_apps_bytes = int(device.memory.other_apps_mb * MB)
        self._ramp: tuple[float, float, float, float] | None = None  # (start s, from bytes, to bytes, span s)
        self.total_bytes = int(device.memory.total_mb * MB)
        bat = device.battery
        self.plugged = bat.plugged if bat else True
        self.battery_wh = bat.capacity_wh * bat.percent / 100 if bat else 0.0
        self.battery_used_wh = 0.0
        self.t = 0.0
        self._steps = 0
        self.power_w = device.power.idle_w
        self.user_cap = 1.0  # scaling_max_freq / cpuinfo_max_freq as the governor set it
        self.hw_duty = 1.0  # the CPU's own thermal control's duty cycle (`cpu.hw_limit_c`; 1: not engaged)
        self.busy_cores = 0.0  # the engine's
        self.other_cores = 0.0  # what background loads got
        self.cpu_psi = 0.0
        self.run_queue = 1
        self.mem_psi = 0.0  # memory PSI some avg10 (%)
        # running figures for the summary
        self.peak_limit_c = self.peak_die_c = self.zone_temp(self.limit_index)
        self.sum_limit_c_s = 0.0
        self.throttled_s = 0.0
        self.wait_s = 0.0  # the engine stopped, waiting for memory
        self.series = Series()
        self._record_every = max(1, round(record_s / self.dt))
        self._tokens_at_record = 0.0

    def zone_temp(self, i: int) -> float:
        return self.thermal.die_c if self._zone_die[i] else self.thermal.case_c

    @property
    def freq_ratio(self) -> float:
        """The clock the cores run at: the lower of the user's cap and the kernel's own cooling step."""
        return min(self.user_cap, self.device.cpu.freq_steps[self.kernel.state])

    def set_cap(self, ratio: float | None) -> None:
        """`scaling_max_freq` written: like the kernel, the highest table frequency at or under the ratio."""
        steps = self.device.cpu.freq_steps
        if ratio is None or ratio >= 1.0 or not self.device.cpu.freq_writable:
            self.user_cap = 1.0
            return
        under = [f for f in steps if f <= ratio + 1e-9]
        self.user_cap = max(under) if under else min(steps)

    def on_tick(self, t: float, _s: Snapshot, _o: EngineObservation | None, decision: Decision) -> None:
        """A GovernorLoop listener, as the daemon's router is: requests go off the device while it misses its SLO."""
        if self.upstream is not None:
            self.upstream.on_tick(t, decision, self.engine)

    def advance_to(self, t: float) -> None:
        """Step the physics on its fixed grid up to `t` (the snapshot is at most one step old)."""
        dt = self.dt
        while self.t + dt <= t + 1e-9:
            self._step(dt)
        self._events(t)  # an event between grid points is seen by a tick it woke (up to a step early)

    def _events(self, t: float) -> None:
        for event in self.driver.events(t):
            if event.plugged is not None:
                self.plugged = event.plugged
            target = None
            if event.other_apps_mb is not None:
                target = event.other_apps_mb * MB
            elif event.free_mb is not None:
                target = max(0.0, self.total_bytes - event.free_mb * MB)
            elif event.other_apps_reset:
                target = self.device.memory.other_apps_mb * MB
            if target is not None:
                self._ramp = (event.at_s, float(self.other_apps_bytes), target, event.ramp_s)
                self._ramp_to(t)
            if event.ambient_c is not None:
                self.thermal.set_ambient(event.ambient_c)

    def _ramp_to(self, t: float) -> None:
        """Other programs' memory on its way from one event's level to the next (linear over `ramp_s`)."""
        if self._ramp is None:
            return
        start, before, after, span = self._ramp
        done = 1.0 if span <= 0 else min(1.0, max(0.0, (t - start) / span))
        self.other_apps_bytes = int(before + done * (after - before))
        if done >= 1.0:
            self._ramp = None

    def _dispatch(self, t: float) -> UpstreamSim | None:
        """New requests to the engine, or to the workload's upstream when the policy's [slo] says so."""
        engine, upstream = self.engine, self.upstream
        for request in self.driver.arrivals(t):
            if upstream is not None and upstream.wants(request, engine):
                upstream.submit(request, t, engine.chat.tokens())
                engine.chat.routed(request)
            else:
                engine.submit(request)
        if upstream is not None:
            for end in upstream.step(t):
                self.driver.answered(end)
        return upstream

    def _step(self, h: float) -> None:
        t = self.t
        self._events(t)
        self._ramp_to(t)
        if self.off_s is not None:
            self._step_off(h)
            return
        engine = self.engine
        upstream = self._dispatch(t)
        engine.memory_left(self.total_bytes - self.other_apps_bytes, t)
        freq, duty = self.freq_ratio, self.hw_duty
        background = self.driver.background_cores(t)
        running = engine.busy()
        big, little = engine.step(t, h, freq * duty, background if running else 0.0)
        self._answered()
        p = self.device.power
        self.busy_cores = big + little
        self._cpu_load(background, running)
        dynamic = p.thread_w * (big + self.other_cores) + self.device.cpu.little_thread_w * little
        self.power_w = p.idle_w + dynamic * duty * freq**p.freq_exponent + (upstream.radio_w() if upstream else 0.0)
        self.thermal.step(self.power_w, h)
        self._hw_control()
        if self.device.battery is not None:
            if self.plugged:
                cap = self.device.battery.capacity_wh
                self.battery_wh = min(cap, self.battery_wh + self.device.battery.charge_w * h / 3600)
            else:
                used = min(self.battery_wh, self.power_w * h / 3600)
                self.battery_wh -= used
                self.battery_used_wh += used
        self._memory_pressure(h)
        self._steps += 1
        self.t = t + h
        if engine.stopped:
            self.wait_s += h
        if self._steps % self._poll_every == 0:
            temps = [self.zone_temp(i) for i in range(len(self._zone_die))]
            self.kernel.poll(temps)
            if any(temps[i] >= critical for i, critical in self._critical):
                self.off_s = self.t
                engine.power_off(self.t)
        if self.kernel.state > 0:
            self.throttled_s += h
        self._account(h, freq * duty)

    def _hw_control(self) -> None:
        """The CPU's own thermal control (x86 TCC, which acts within milliseconds): at its limit the duty cycle halves
        each step, down to an eighth; a degree under it, it comes back a fiftieth a step (the kernel sees only the
        clock it averages)."""
        limit = self.device.cpu.hw_limit_c
        if limit is None:
            return
        if self.thermal.die_c >= limit:
            self.hw_duty = max(0.125, self.hw_duty / 2)
        elif self.thermal.die_c < limit - 1.0:
            self.hw_duty = min(1.0, self.hw_duty + 0.02)

    def _step_off(self, h: float) -> None:
        """Powered off: no power, nothing runs; every request asked fails (none goes to an upstream: the router is
        off too)."""
        engine = self.engine
        for request in self.driver.arrivals(self.t):
            engine.submit(request)
        self._answered()
        self.busy_cores = self.other_cores = self.power_w = self.cpu_psi = 0.0
        self.thermal.step(0.0, h)
        self._steps += 1
        self.t += h
        self._account(h, 0.0)

    def _answered(self) -> None:
        """Answers that ended (or failed) since the last step: the chat's user reads, thinks and asks again."""
        finished = self.engine.answering.finished
        for end in finished:
            self.driver.answered(end)
        finished.clear()

    def _account(self, h: float, freq: float) -> None:
        """The step's share of the run's figures, and the series at its resolution."""
        limit = self.zone_temp(self.limit_index)
        self.peak_limit_c = max(self.peak_limit_c, limit)
        self.peak_die_c = max(self.peak_die_c, self.thermal.die_c)
        self.sum_limit_c_s += limit * h
        if self._steps % self._record_every == 0:
            s, tokens = self.series, self.engine.stats.tokens
            s.t.append(self.t)
            s.limit_c.append(limit)
            s.die_c.append(self.thermal.die_c)
            s.tokens_per_s.append((tokens - self._tokens_at_record) / (h * self._record_every))
            self._tokens_at_record = tokens
            s.freq_ratio.append(freq)
            s.power_w.append(self.power_w)

    def _cpu_load(self, background: float, running: bool) -> None:
        """What the others got, CPU pressure and the run queue, as /proc shows them."""
        engine, cores = self.engine, self.device.cpu.cores
        # Others get what they want unless the engine's threads compete for the cores: then every runnable task gets
        # the same share of a core (8 build tasks beside 4 engine threads on 4 cores: 8 x 4/12 cores, not 4 x 4/12).
        self.other_cores = min(cores, background * (engine.share(background) if running else 1.0))
        threads = engine.config.threads if running and engine.config is not None else 0
        self.cpu_psi = 100.0 * min(1.0, max(0.0, min(threads, cores) + background - cores) / cores)
        self.run_queue = threads + math.ceil(background) + 1  # /proc/stat procs_running: the reader counts itself

    def _memory_pressure(self, h: float) -> None:
        """PSI some avg10: rises linearly from 0 to 50 % as available memory falls under PSI_KNEE of RAM, averaged
        over PSI_WINDOW_S."""
        knee = PSI_KNEE * self.total_bytes
        stalled = max(0.0, min(100.0, 50.0 * (knee - self.available_bytes()) / knee))
        self.mem_psi += (stalled - self.mem_psi) * (1.0 - math.exp(-h / PSI_WINDOW_S))

    def available_bytes(self) -> int:
        return max(0, self.total_bytes - self.other_apps_bytes - self.engine.resident_bytes())

    def snapshot(self) -> Snapshot:
        temps = tuple(
            Temperature(
                source=f"sim:zone{i}", kind="simulated", label=z.label, temp_c=self.zone_temp(i), trips=self._trips[i]
            )
            for i, z in enumerate(self.device.zone)
        )
        battery = None
        spec = self.device.battery
        if spec is not None:
            charging = self.plugged and self.battery_wh < spec.capacity_wh
            battery = Battery(
                percent=100 * self.battery_wh / spec.capacity_wh,
                charging=charging,
                plugged=self.plugged,
                power_w=spec.charge_w if charging else (0.0 if self.plugged else self.power_w),
                temp_c=self.thermal.case_c,
                source="simulated",
                energy_wh=self.battery_wh,
                energy_full_wh=spec.capacity_wh,
            )
        available = self.available_bytes()
        cpu = self.device.cpu
        return Snapshot(
            temperatures=temps,
            battery=battery,
            memory=Memory(
                total_bytes=self.total_bytes,
                available_bytes=available,
                psi_some_avg10=round(self.mem_psi, 2),
                lmkd=not self.device.engine.weights_reclaimable,  # the device's killer counts the mapped weights
            ),
            cpu=Cpu(
                freq_ratio=self.freq_ratio * self.hw_duty,  # what APERF/MPERF average: the modulation too
                throttled=self.kernel.state > 0,
                count=cpu.cores,
                util_percent=100 * (self.busy_cores + self.other_cores) / cpu.cores,
                other_cores=round(self.other_cores, 3),
                engine_cores=round(self.busy_cores, 3),
                psi_some_avg10=round(self.cpu_psi, 2),
                run_queue=self.run_queue,
                clusters=self._clusters,
            ),
        )
