"""The small pieces the composition root wires: uevents wake the loop, metrics, the engine's RSS from outside."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from govbase.errors import GovernorError
from governor.cli import build_parser
from governor.clock import RealClock
from governor.daemon.app import engine_options, policy_loader, uevent_handler
from governor.daemon.desired import DesiredEngine
from governor.daemon.engine import SupervisedEngine
from governor.daemon.llamacpp import CAPABILITIES, engine_command
from governor.daemon.metrics import DaemonMetrics
from governor.daemon.restarts import RestartPolicy
from governor.daemon.supervisor import EngineSupervisor
from governor.engine.serve import initial
from policies import StateMachine, load_policy
from policies.decision import Decision, EngineConfig, State
from policies.ladder import ModelLadder, ModelTier, load_ladder
from policies.schema import EngineOptions
from sensors.events import UdevEvent
from sensors.sampler import SensorSampler
from sensors.snapshot import Battery, EngineObservation, Snapshot, Temperature
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

CFG = EngineConfig(threads=3, n_ctx=1024, model="large", max_tokens_per_s=6.0)
HOT = Decision(t=1.0, state=State.HOT, engine=CFG, reason="hot: 81 °C", rule="thermal.enter", changed=True)


def test_a_uevent_wakes_the_loop_and_a_new_supply_is_discovered(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    tree.battery(status="Discharging", capacity=50)
    sampler = SensorSampler(tmp_path, cpu_util=None)
    assert sampler.sample().battery is not None
    wake = threading.Event()
    handler = uevent_handler(sampler, wake)
    tree.mains(online=1)  # the charger appears: a new power_supply device
    handler(UdevEvent(action="add", subsystem="power_supply", name="AC"))
    assert wake.is_set()
    battery = sampler.sample().battery
    assert battery is not None
    assert battery.plugged is True  # rediscovered at once, not after the 30 s rediscovery period


def test_a_power_supply_change_uevent_makes_the_woken_tick_read_the_supply(tmp_path: Path) -> None:
    tree = FakeTree(tmp_path)
    tree.battery(status="Charging", capacity=50)
    tree.mains(online=1)
    sampler = SensorSampler(tmp_path, cpu_util=None, slow_max_age_s=3600.0)  # the daemon's cap, made long
    battery = sampler.sample().battery
    assert battery is not None
    assert battery.plugged is True
    tree.write("sys/class/power_supply/AC/online", 0)  # the charger pulled: the kernel sends a "change" uevent
    tree.write("sys/class/power_supply/BAT0/status", "Discharging")
    wake = threading.Event()
    uevent_handler(sampler, wake)(UdevEvent(action="change", subsystem="power_supply", name="AC"))
    assert wake.is_set()
    battery = sampler.sample().battery
    assert battery is not None
    assert battery.plugged is False


def test_metrics_text_and_textfile(tmp_path: Path) -> None:
    textfile = tmp_path / "node/governor.prom"
    metrics = DaemonMetrics(textfile=textfile, extra=lambda: {"engine_starts": 2.0})
    snapshot = Snapshot(
        temperatures=(Temperature(source="thermal_zone0", kind="thermal_zone", label="cpu-thermal", temp_c=81.5),),
        battery=Battery(percent=40.0, charging=False, plugged=False, power_w=3.0, temp_c=30.0, source="sysfs:BAT0"),
    )
    metrics.on_tick(10.0, snapshot, EngineObservation(busy=True, tokens_per_s=7.5, rss_bytes=123), HOT)
    text = metrics.text()
    assert 'governor_state{state="hot"} 1.0' in text
    assert 'governor_state{state="idle"} 0.0' in text
    assert "governor_engine_threads 3.0" in text
    assert "governor_engine_max_tokens_per_s 6.0" in text
    assert 'governor_engine_model{model="large"} 1.0' in text
    assert "governor_engine_tokens_per_second 7.5" in text
    assert 'governor_temperature_celsius{label="cpu-thermal",source="thermal_zone0"} 81.5' in text
    assert "governor_battery_percent 40.0" in text
    assert "governor_decision_changes_total 1.0" in text
    assert 'governor_supervisor{figure="engine_starts"} 2.0' in text
    # node_exporter's textfile collector reads the same, written on the metrics' own thread (never the loop's)
    assert eventually(lambda: textfile.exists() and textfile.read_text()) == text
    metrics.close()
    assert DaemonMetrics().text() != text  # each daemon has its own registry


class NoRssEngine:
    capabilities = CAPABILITIES

    def observe(self) -> EngineObservation:
        return EngineObservation(busy=False)

    def apply(self, config: EngineConfig) -> None:
        del config

    def pause(self, reason: str | None) -> None:
        del reason

    def prepare_restart(self, config: EngineConfig) -> None:
        del config


class PauseRecorder(NoRssEngine):
    """An engine link that records what it was told, and on which thread."""

    def __init__(self) -> None:
        self.pauses: list[str | None] = []
        self.applied: list[EngineConfig] = []
        self.threads: set[str] = set()

    def apply(self, config: EngineConfig) -> None:
        self.threads.add(threading.current_thread().name)
        self.applied.append(config)

    def pause(self, reason: str | None) -> None:
        self.threads.add(threading.current_thread().name)
        self.pauses.append(reason)


class Answering(BaseModel):
    """The status an engine answering on the socket reports: its pid."""

    model_config = ConfigDict(extra="allow")


def sleeper_supervisor(desired: DesiredEngine, started: list[EngineConfig] | None = None) -> EngineSupervisor:
    def command(config: EngineConfig, _extra_buffers: str | None) -> list[str]:
        if started is not None:
            started.append(config)
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    supervisor = EngineSupervisor(
        command=command,
        ready=lambda _t: Answering(pid=supervisor.pid),  # the engine answering is ours
        desired=desired,
        ladder=ModelLadder(tier=(ModelTier(name="large", path=Path("large.gguf")),)),
        restart=RestartPolicy(),
        clock=RealClock(),
    )
    supervisor.start()
    return supervisor


def test_the_engine_is_told_to_pause_once_while_nothing_fits_and_to_resume_after() -> None:
    wait = "no tier fits in 12 MiB; waiting for memory"
    link = PauseRecorder()
    desired = DesiredEngine(link)
    supervisor = sleeper_supervisor(desired)
    engine = SupervisedEngine(link, supervisor, desired)
    try:
        engine.apply(HOT)
        eventually(lambda: supervisor.ready)
        eventually(lambda: link.applied == [CFG])  # once ready (it started with these settings as flags)
        squeezed = HOT.model_copy(update={"engine_wait": wait})
        for decision in (HOT, squeezed, squeezed, squeezed):
            desired.want(decision.engine, decision.engine_wait)  # the running engine: supervisor.hold would stop it
        eventually(lambda: link.pauses == [wait])
        engine.apply(HOT)
        eventually(lambda: link.pauses == [wait, None])
        one_thread = HOT.model_copy(update={"engine": CFG.model_copy(update={"threads": 1})})
        engine.apply(one_thread)  # a config after it does not repeat the pause
        eventually(lambda: link.applied[-1:] == [one_thread.engine])
        assert link.pauses == [wait, None]
        assert link.applied == [CFG, one_thread.engine]  # each once: a repeated decision sends nothing
    finally:
        supervisor.stop(5.0)
        engine.restore()


def test_one_writer_sends_the_engine_its_settings_whoever_asks() -> None:
    """Start, ready, a decision and a drift all ask the owner (governor.daemon.desired); only its thread posts."""
    link = PauseRecorder()
    desired = DesiredEngine(link)
    started: list[EngineConfig] = []
    supervisor = sleeper_supervisor(desired, started)
    engine = SupervisedEngine(link, supervisor, desired)
    try:
        engine.apply(HOT)  # a decision: the first starts the engine with its settings (the same message, as flags)
        eventually(lambda: link.applied == [CFG])  # ready: sent once more, in case it changed while loading
        assert started == [CFG]
        desired.check(
            CFG.model_copy(update={"threads": 1})
        )  # drift: someone else posted to the engine; ours goes again
        eventually(lambda: link.applied == [CFG, CFG])
        two = HOT.model_copy(update={"engine": CFG.model_copy(update={"threads": 2})})
        engine.apply(two)
        eventually(lambda: link.applied == [CFG, CFG, two.engine])
        assert link.threads == {"engine-settings"}  # never the loop's, the supervisor's or the probe's thread
        assert desired.status()["converged"] is True
    finally:
        supervisor.stop(5.0)
        engine.restore()


def test_nothing_but_the_owner_posts_engine_settings() -> None:
    """In the daemon's source, one module asks a driver to apply settings (a second caller is a second writer); the
    drivers pass the message on (the llama-cpp-python driver through its client, whose `apply` posts the whole config).
    The lab's simulated engine is not the daemon's."""
    root = Path(__file__).resolve().parents[3] / "governor"
    callers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.parent.name != "lab"
        and re.search(r"\b(link|driver|client|engine)\.apply\(|\.configure\(\*\*", path.read_text())
    )
    assert callers == ["daemon/desired.py", "daemon/llamacpp.py", "engine/client.py"]


def test_engine_rss_is_read_from_outside_when_the_engine_does_not_say() -> None:
    desired = DesiredEngine(NoRssEngine())
    supervisor = sleeper_supervisor(desired)
    engine = SupervisedEngine(NoRssEngine(), supervisor, desired)
    try:
        assert engine.observe() is None  # nothing started yet
        engine.apply(HOT)
        observed = eventually(engine.observe)
        assert observed is not None
        assert observed.rss_bytes is not None
        assert observed.rss_bytes > 1 << 20
        assert supervisor.pid is not None
        assert supervisor.pid != os.getpid()
    finally:
        supervisor.stop(5.0)
        engine.restore()


def test_the_engine_gets_the_policys_engine_options(tmp_path: Path) -> None:
    options = EngineOptions(keep_alive_s=42.0, stream_interval_ms=0.0)
    policy = load_policy("default").model_copy(update={"engine": options})
    cfg = EngineConfig(threads=1, n_ctx=512, kv_type="f16", model="small")
    argv = engine_command(tmp_path / "l.toml", tmp_path / "e.sock", cfg, options=engine_options(StateMachine(policy)))
    assert argv[argv.index("--keep-alive") + 1] == "42"
    assert argv[argv.index("--stream-interval-ms") + 1] == "0"
    default = engine_command(tmp_path / "l.toml", tmp_path / "e.sock", cfg, options=load_policy("default").engine)
    assert default[default.index("--keep-alive") + 1] == "300"
    assert "--stream-interval-ms" not in default  # auto: the engine decides from its threads and the CPUs


def test_the_engine_child_starts_with_every_setting_of_the_decision(tmp_path: Path, demo_ladder: Path) -> None:
    cfg = EngineConfig(threads=1, n_ctx=512, kv_type="f16", model="small", max_tokens_per_s=2.5)
    argv = engine_command(demo_ladder, tmp_path / "e.sock", cfg)
    assert argv[argv.index("--max-tokens-per-s") + 1] == "2.5"
    args = build_parser().parse_args(argv[argv.index("engine") :])
    assert initial(args)[1] == cfg  # what the engine parses from its command line is the decision


def test_a_bench_device_file_is_the_device_models_prior_and_a_bad_one_is_refused(
    tmp_path: Path, demo_ladder: Path
) -> None:
    device = tmp_path / "device.toml"
    device.write_text("[power]\nidle_w = 3.0\ncore_w = 0.9\nthread_tok_s = 7.5\n")
    load = policy_loader(load_ladder(demo_ladder), demo_ladder, (0.5, 0.75, 1.0), device)
    governor = load("default")
    assert isinstance(governor, StateMachine)
    assert governor.power.enabled
    assert governor.power.model.a == 7.5
    assert governor.power.model.idle_w == 3.0
    device.write_text("[power]\nthread_tok_s = 0\n")  # read again at every (re)load: a reload would keep the last good
    with pytest.raises(GovernorError, match=r"device\.toml: power\.thread_tok_s"):
        load("default")
