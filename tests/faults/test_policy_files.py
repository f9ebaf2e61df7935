"""Malformed policy files: `governor policy check` says what is wrong in one line (no traceback, no hang), and a
reload of the victim daemon with the same file keeps the last good policy and the daemon running."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from governor.daemon.control import ControlError
from tests.faults.conftest import FAULT_POLICY
from tests.governor.daemon.daemon_proc import DaemonProc

FAULT_KIND = "policy files"

GOOD = FAULT_POLICY


def replace(old: str, new: str) -> bytes:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1).encode()


def in_table(table: str, line: str) -> bytes:
    return replace(f"[{table}]\n", f"[{table}]\n{line}\n")


# (id, content: bytes, or a callable making a non-regular file at the path; a fragment of the expected message)
Maker = Callable[[Path], None]
CASES: list[tuple[str, bytes | Maker, str]] = [
    ("invalid UTF-8", GOOD.encode() + b"\n# caf\xe9\n", "not UTF-8"),
    ("binary garbage", bytes(range(256)) * 8, "binary data"),
    ("UTF-16 with a BOM", GOOD.encode("utf-16"), "binary data"),
    ("50,000-deep array", b"a = " + b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    ("10,000-deep inline tables", b"a = " + b"{b = " * 10_000 + b"1" + b"}" * 10_000, "nested too deeply"),
    ("2 MB file", GOOD.encode() + b"# " + b"x" * (2 << 20) + b"\n", "too large"),
    ("a 5000-digit integer", in_table("timing", "interval_s = " + "9" * 5000), "not valid TOML"),
    ("interval_s = 1e10", replace("interval_s = 0.5", "interval_s = 1e10"), "timing.interval_s"),
    ("interval_s = inf", replace("interval_s = 0.5", "interval_s = inf"), "timing.interval_s"),
    ("interval_s = nan", replace("interval_s = 0.5", "interval_s = nan"), "timing.interval_s"),
    ("interval_s = 0", replace("interval_s = 0.5", "interval_s = 0"), "timing.interval_s"),
    ("interval_s = -1", replace("interval_s = 0.5", "interval_s = -1"), "timing.interval_s"),
    ("interval_s a date", replace("interval_s = 0.5", "interval_s = 1979-05-27"), "timing.interval_s"),
    ("reserve_mb = inf", replace("[battery]", "[memory]\nreserve_mb = inf\n[battery]"), "memory.reserve_mb"),
    (
        "hot max_tokens_per_s = inf",
        replace("max_tokens_per_s = 60.0\nmin_tokens_per_s", "max_tokens_per_s = inf\nmin_tokens_per_s"),
        "states.hot.max_tokens_per_s",
    ),
    (
        "max_tokens_per_s = 1e-300",
        replace("max_tokens_per_s = 10.0", "max_tokens_per_s = 1e-300"),
        "states.critical.max_tokens_per_s",
    ),
    ('threads = "4"', replace("threads = 4", 'threads = "4"'), "states.idle.threads"),
    ("threads = 4.0", replace("threads = 4", "threads = 4.0"), "states.idle.threads"),
    ("threads = true", replace("threads = 4", "threads = true"), "states.idle.threads"),
    ("threads = 0", replace("threads = 4", "threads = 0"), "states.idle.threads"),
    ("threads = 100000", replace("threads = 4", "threads = 100000"), "states.idle.threads"),
    ("n_ctx = -1", replace("n_ctx = 1024", "n_ctx = -1"), "states.idle.n_ctx"),
    ("min_threads > threads", replace("min_threads = 1", "min_threads = 3"), "min_threads 3 > threads 2"),
    ("unknown kv_type", in_table("states.idle", 'kv_type = "q2"'), "states.idle.kv_type"),
    ("unknown key", in_table("thermal", "hysteresis_cc = 4"), "unknown key"),
    (
        "unknown state",
        replace("[states.sustained]", "[states.sleepy]\nthreads = 1\nn_ctx = 512\n[states.sustained]"),
        "states.sleepy",
    ),
    (
        "missing state",
        replace("[states.low_battery]\nthreads = 2\nn_ctx = 1024\nmax_tokens_per_s = 30.0\n", ""),
        "missing a profile",
    ),
    (
        "hot without a rate cap",
        replace("max_tokens_per_s = 60.0\nmin_tokens_per_s = 20.0\n", ""),
        "max_tokens_per_s is required",
    ),
    ("hysteresis: exit above enter", in_table("activity", "exit_fraction = 0.9"), "exit_fraction"),
    ("critical above low battery", in_table("battery", "critical_percent = 50"), "critical_percent"),
    ("trip_c = 1e6", in_table("thermal", "trip_c = 1e6"), "thermal.trip_c"),
    ("hysteresis_c = 0", in_table("thermal", "hysteresis_c = 0"), "thermal.hysteresis_c"),
    ("psi_exit above psi_enter", replace("[battery]", "[memory]\npsi_exit = 50\n[battery]"), "psi_exit"),
    ("zones a string", in_table("thermal", 'zones = "cpu*"'), "thermal.zones"),
    ("zones numbers", in_table("thermal", "zones = [1, 2]"), "thermal.zones"),
    ("name a number", ("name = 5\n" + GOOD.split("\n", 2)[2]).encode(), "name"),
    ("timing a number", replace("[timing]\n", "timing = 5\n[timingx]\n"), "timing"),
    ("states an array", b"states = []\n", "states"),
    ("truncated TOML", GOOD.encode()[: GOOD.index("[states.hot]") + 8], "not valid TOML"),
    ("duplicate key", in_table("timing", "interval_s = 1.0"), "not valid TOML"),
    ("empty file", b"", "states: Field required"),
    ("description 20,000 characters", ('description = "' + "d" * 20_000 + '"\n' + GOOD).encode(), "description"),
    ("a FIFO", os.mkfifo, "not a regular file (a FIFO)"),
    ("a directory", lambda p: p.mkdir(), "not a regular file (a directory)"),
    ("a device (/dev/zero)", lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
    ("missing", lambda p: None, "No such file"),
]
IDS = [c[0] for c in CASES]


def put(path: Path, content: bytes | Maker) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        content(path)


@pytest.fixture
def restore_policy(victim: DaemonProc) -> Iterator[Path]:
    yield victim.policy
    put(victim.policy, GOOD.encode())


@pytest.mark.parametrize(("content", "fragment"), [c[1:] for c in CASES], ids=IDS)
def test_policy_check_says_what_is_wrong_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | Maker, fragment: str
) -> None:
    from governor.cli import main

    path = tmp_path / "policy.toml"
    put(path, content)
    assert main(["policy", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"governor: error: {path}"), err[:500]
    assert err.count("\n") == 1, err[:500]
    assert fragment in err, err[:500]


test_policy_check_says_what_is_wrong_in_one_line.fault_kind = "policy files: `policy check`"  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize(("content", "fragment"), [c[1:] for c in CASES], ids=IDS)
def test_reload_keeps_the_last_good_policy(
    victim: DaemonProc, restore_policy: Path, content: bytes | Maker, fragment: str
) -> None:
    put(restore_policy, content)
    with pytest.raises(ControlError, match="reload failed, kept the last good policy") as err:
        victim.client.request("reload")
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)
    status = victim.status()
    assert fragment in (status["policy"]["error"] or "")
    assert status["policy"]["name"] == str(restore_policy)
    assert status["errors"]["loop"] == 0


test_reload_keeps_the_last_good_policy.fault_kind = "policy files: reload of the running daemon"  # type: ignore[attr-defined]


@pytest.mark.slow
def test_policy_check_on_a_fifo_does_not_hang(tmp_path: Path) -> None:
    """As a user runs it: a child process, which must answer promptly with one line and no traceback."""
    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "governor", "policy", "check", str(fifo)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert done.stderr == f"governor: error: {fifo}: not a regular file (a FIFO)\n"
