"""What `governor status` and `governor why` show for the states a user asks about."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from governor.daemon.render import status_table, why_table

NOW = 1_800_000_000.0
CONFIG = {"threads": 1, "n_ctx": 512, "kv_type": "q4_0", "model": "small", "max_tokens_per_s": 2.0}


def shown(status: dict[str, Any]) -> str:
    console = Console(record=True, width=160)
    status_table(status, console, now=NOW)
    return console.export_text()


def test_critical_after_the_engine_was_given_up() -> None:
    text = shown(
        {
            "state": "critical",
            "since": NOW - 90,
            "reason": "critical: engine failed 5 times in a row, last: engine exited with status 1 after 0.4 s",
            "config": CONFIG,
            "engine": None,
            "policy": {"name": "raspberry-pi", "error": "pi.toml:3: states.idle.threadz: Extra inputs"},
            "supervisor": {"pid": None, "last_exit": "engine exited with status 1 after 0.4 s", "critical": "gave up"},
            "holds": [
                {
                    "id": 3,
                    "owner": "pid 42 uid 1000",
                    "state": "idle",
                    "max_threads": None,
                    "max_tokens_per_s": None,
                    "expires_in_s": 25.0,
                }
            ],
            "readings": {
                "temperatures": [
                    {
                        "source": "thermal_zone0",
                        "label": "cpu-thermal",
                        "temp_c": 81.2,
                        "trips": [{"type": "passive", "temp_c": 80.0}],
                    }
                ],
                "battery": {"source": "sysfs:BAT0", "percent": 12.0, "plugged": False},
                "memory": {"available_bytes": 300 * 2**20, "psi_some_avg10": 12.5},
                "cpu": {"freq_ratio": 0.5, "throttled": True},
                "problems": [{"path": "sys/class/hwmon/hwmon1/temp1_input", "reason": "EIO"}],
            },
        }
    )
    assert "critical since" in text
    assert "(90 s ago)" in text
    assert "engine failed 5 times in a row" in text
    assert "reload failed: pi.toml:3: states.idle.threadz" in text
    assert "not answering (engine exited with status 1 after 0.4 s)" in text
    assert "threads 1, n_ctx 512, KV q4_0, model small, rate cap 2 tok/s" in text
    assert "state idle by pid 42 uid 1000, 25 s left" in text
    assert "81.2 °C" in text
    assert "passive 80" in text
    assert "12 %" in text
    assert "on battery" in text
    assert "300 MiB" in text
    assert "PSI some 12.5 %" in text
    assert "throttled" in text
    assert "EIO" in text


def test_memory_cap_and_a_busy_engine() -> None:
    text = shown(
        {
            "state": "sustained",
            "since": NOW - 4000,
            "reason": "sustained: busy 80 % of the last 30 s",
            "config": {**CONFIG, "max_tokens_per_s": None},
            "engine": {"busy": True, "tokens_per_s": 21.5, "rss_bytes": 380 * 2**20},
            "policy": {"name": "default", "error": None},
            "supervisor": {"pid": 77, "cap": {"model": "medium", "n_ctx": 2048, "reason": "SIGKILL under PSI 60%"}},
            "holds": [],
            "readings": {},
        }
    )
    assert "(67 min ago)" in text
    assert "no rate cap" in text
    assert "generating, 21.5 tok/s, RSS 380 MiB, pid 77" in text
    assert "capped at medium/n_ctx 2048: SIGKILL under PSI 60%" in text
    assert "reload failed" not in text


def test_a_daemon_that_has_not_ticked_yet() -> None:
    assert "starting" in shown({"state": None, "since": None, "reason": None, "config": None, "engine": None})


def test_why_lists_decisions_with_their_reasons() -> None:
    console = Console(record=True, width=160)
    decision = {"wall": NOW, "state": "hot", "engine": {**CONFIG, "threads": 2}, "reason": "hot: forecast 78.4 °C"}
    why_table([decision], console)
    text = console.export_text()
    assert "threads 2, n_ctx 512, KV q4_0, model small, rate cap 2 tok/s" in text
    assert "hot: forecast 78.4 °C" in text


def test_text_from_clients_and_sensors_cannot_style_or_drive_the_terminal() -> None:
    """Rich markup is escaped ("[/]" once crashed `governor status` for everyone) and control characters dropped."""
    console = Console(record=True, width=200, force_terminal=True)
    status = {
        "state": "idle",
        "reason": "idle: [bold red]forged[/] \x1b[2J\x07",
        "config": CONFIG,
        "engine": None,
        "policy": {"name": "[/]", "error": None},
        "supervisor": {"pid": None, "last_exit": "[/]\x1b]0;title\x07"},
        "holds": [{"id": 1, "owner": "[/] \x1b[31mroot\x9b", "state": "idle", "expires_in_s": None}],
        "readings": {"problems": [{"path": "/sys/x[/]", "reason": "not a number: '\x1b[2J'"}]},
    }
    status_table(status, console, now=NOW)
    why_table([{"wall": NOW, "state": "idle", "engine": CONFIG, "reason": "[/] \x1b[2J"}], console)
    out = console.export_text(styles=True, clear=False)
    for raw in ("\x1b[2J", "\x07", "\x9b", "\x1b]0;"):
        assert raw not in out
    plain = console.export_text()
    assert "[bold red]forged[/]" in plain  # shown as the text it is, not applied
    assert "by [/] [31mroot" in plain


def test_the_clock_cap_and_where_it_cannot_be_written() -> None:
    base = {"state": "hot", "since": NOW - 5, "reason": "hot: ...", "config": CONFIG, "engine": None}
    cluster = {"policy": "policy4", "cpus": "4-7", "writable": True, "cap_khz": 1_608_000, "max_khz": 2_400_000}
    capped = {"writable": True, "reason": "", "freq_cap_khz": 1_608_000, "clusters": [cluster]}
    text = shown(base | {"actuators": {"cpufreq": capped}})
    assert "cpu clock" in text
    assert "capped: policy4 1.61 of 2.40 GHz (restored on exit)" in text
    pstate = {"policy": "intel_pstate", "cpus": "all", "writable": True, "cap_khz": 60, "max_khz": 100, "unit": "%"}
    only_pstate = {"writable": True, "reason": "", "freq_cap_khz": None, "clusters": [pstate]}
    text = shown(base | {"actuators": {"cpufreq": only_pstate}})
    assert "capped: intel_pstate 60 % of the top P-state (restored on exit)" in text
    package = {"policy": "intel-rapl:0", "cpus": "package-0", "writable": True, "cap_khz": 9_000_000}
    with_rapl = only_pstate | {"clusters": [pstate, package | {"max_khz": 15_000_000, "unit": "µW"}]}
    text = shown(base | {"actuators": {"cpufreq": with_rapl}})
    assert "intel_pstate 60 % of the top P-state, intel-rapl:0 (package-0) 9.0 of 15.0 W (restored" in text
    unwritable = {"writable": False, "reason": "scaling_max_freq is not writable: threads and rate are the actuators"}
    text = shown(base | {"actuators": {"cpufreq": unwritable | {"freq_cap_khz": None, "clusters": []}}})
    assert "not writable: threads and rate are the actuators" in text


def test_an_engine_that_unloaded_its_model_says_so() -> None:
    engine = {"busy": False, "tokens_per_s": 0.0, "rss_bytes": 80 * 2**20, "loaded": False}
    text = shown({"state": "idle", "since": NOW - 400, "reason": "idle", "config": CONFIG, "engine": engine})
    assert "unloaded (idle)" in text
    assert "unloaded" not in shown({"state": "idle", "since": NOW, "reason": "idle", "config": CONFIG,
                                    "engine": {**engine, "loaded": True}})  # fmt: skip


def test_a_crashing_engine_being_restarted_on_safer_settings() -> None:
    crashes = (
        "engine crashes: SIGSEGV in the first decode of tier large, 2 times in 9 s; tried extra buffers off and tier "
        "medium; last engine stderr: ggml [cpu] amx: oops"
    )
    text = shown(
        {
            "state": "idle",
            "since": NOW - 10,
            "reason": "idle: nothing running",
            "config": CONFIG,
            "engine": None,
            "policy": {"name": "default", "error": None},
            "supervisor": {
                "pid": None,
                "last_exit": "engine killed by SIGSEGV after 2.0 s, in the first decode; restarting with tier medium",
                "retry_in_s": 3.6,
                "crashes": crashes,
                "critical": None,
            },
            "holds": [],
            "readings": {},
        }
    )
    assert "in the first decode; restarting with tier medium); restarting in 4 s" in " ".join(text.split())
    assert crashes in " ".join(text.split())  # rich markup in the engine's words is shown as written


def test_a_given_up_crash_loop_says_what_to_do() -> None:
    text = shown(
        {
            "state": "critical",
            "since": NOW - 10,
            "reason": "critical: engine crashes: SIGSEGV during load of tier large, 3 times in 7 s",
            "config": CONFIG,
            "engine": None,
            "policy": {"name": "default", "error": None},
            "supervisor": {"critical": "engine crashes: SIGSEGV during load of tier large, 3 times in 7 s"},
            "holds": [],
            "readings": {},
        }
    )
    flat = " ".join(text.split())
    assert (
        "given up: engine crashes: SIGSEGV during load of tier large, 3 times in 7 s (governor reload tries again)"
        in flat
    )


def test_the_engine_kind_and_how_it_takes_each_setting() -> None:
    llama_server = {"engine": "llama-server", "managed": True, "live": ["max_tokens_per_s"], "reload": [],
                    "restart": ["threads", "n_ctx", "kv_type", "model", "n_batch"]}  # fmt: skip
    external = {"engine": "external (Ollama)", "managed": False, "live": ["max_tokens_per_s", "threads"], "reload": [],
                "restart": [], "cannot": ["kv_type", "n_batch"]}  # fmt: skip

    for driver, line in (
        (llama_server, "llama-server: changes live max_tokens_per_s; by a restart threads, n_ctx, kv_type, model, "),
        (external, "external (Ollama): changes live max_tokens_per_s, threads; cannot change kv_type, n_batch"),
    ):
        text = shown({"state": "idle", "since": NOW, "config": CONFIG, "actuators": {"engine": {"driver": driver}}})
        assert line in " ".join(text.split())
