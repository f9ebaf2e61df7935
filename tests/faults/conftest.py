"""The fault suite: one real daemon (with its engine) takes every malformed input; a table counts the cases.

Each test module names its kind of fault (`FAULT_KIND`); a test that passes is a fault the daemon handled, a test
that fails is one it got wrong. The table (tried / handled / wrong) is printed at the end of the run and is the one
docs/reliability.md shows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc

# The daemon the whole suite attacks: short ticks, a short grace for an untrustworthy temperature, a quick hang check.
FAULT_POLICY = TEST_POLICY.replace("forecast_horizon_s = 0.0", "forecast_horizon_s = 0.0\nuntrusted_grace_s = 0.5")
FAULT_CONFIG = """\
[restart]
initial_s = 0.2
max_failures = 50
probe_interval_s = 0.5
probe_timeout_s = 0.5
hang_s = 2.0
"""

_tally: Counter[tuple[str, str]] = Counter()
_order: list[str] = []


@pytest.fixture(scope="session")
def victim(tmp_path_factory: pytest.TempPathFactory, demo_ladder: Path) -> Iterator[DaemonProc]:
    """The daemon that takes the whole fault run; the last test checks it still serves with the last good policy."""
    work = tmp_path_factory.mktemp("victim")
    sockets = Path(tempfile.mkdtemp(prefix="gvf", dir="/tmp"))
    d = DaemonProc(work, sockets, demo_ladder, policy=FAULT_POLICY, config=FAULT_CONFIG)
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        shutil.rmtree(sockets, ignore_errors=True)


@contextlib.contextmanager
def opened_to_others(path: Path) -> Iterator[None]:
    """`path` (a socket) and its directory opened to another local user, as a group member would be let in."""
    sock_dir = path.parent
    dir_mode, sock_mode = os.stat(sock_dir).st_mode & 0o7777, os.stat(path).st_mode & 0o7777
    os.chmod(sock_dir, 0o711)
    os.chmod(path, 0o666)
    try:
        yield
    finally:
        os.chmod(path, sock_mode)
        os.chmod(sock_dir, dir_mode)


def _kind(item: pytest.Item) -> str | None:
    function = getattr(item, "function", None)
    module = getattr(item, "module", None)
    kind = getattr(function, "fault_kind", None) or getattr(module, "FAULT_KIND", None)
    return str(kind) if kind else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    kind = _kind(item)
    if kind is not None and (report.when == "call" or (report.when == "setup" and report.failed)):
        if kind not in _order:
            _order.append(kind)
        if report.passed:
            _tally[kind, "handled"] += 1
        elif report.failed:
            _tally[kind, "wrong"] += 1
    return report


def fault_table() -> str:
    rows = ["| fault | tried | handled | wrong |", "| --- | ---: | ---: | ---: |"]
    total = Counter[str]()
    for kind in _order:
        handled, wrong = _tally[kind, "handled"], _tally[kind, "wrong"]
        rows.append(f"| {kind} | {handled + wrong} | {handled} | {wrong} |")
        total["handled"] += handled
        total["wrong"] += wrong
    rows.append(f"| **all** | {total['handled'] + total['wrong']} | {total['handled']} | {total['wrong']} |")
    return "\n".join(rows)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _order:
        terminalreporter.section("fault table (tests/faults)")
        terminalreporter.write_line(fault_table())
