"""`governor dashboard` in a real browser: Debian's chromium driven by Playwright (executable_path; Playwright's own
browser download is never used), against a real daemon on a fake device tree.

The page loads with no console error and asks nothing of any other host; its temperature graph moves when the fake
zone heats and a decision appears with its reason; holds and reload work only with the printed token.
GOVERNOR_SCREENSHOTS=1 writes docs/img/dashboard.png (the README's).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from governor.views.dashboard import Holds, _HoldRequest
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.governor.views.conftest import ZONE_TEMP
from tests.helpers import eventually

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium on a closed network: no background calls home (each one refused, or a name that does not resolve).
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps",
]  # fmt: skip
WAIT_MS = 20_000


class Dashboard:
    def __init__(self, live: DaemonProc) -> None:
        argv = [sys.executable, "-m", "governor", "dashboard", "--control-socket", str(live.control)]
        self.proc = subprocess.Popen(
            [*argv, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:  # whatever goes wrong here, the process does not outlive the test
            said = [self.lines.get(timeout=30), self.lines.get(timeout=30)]
            read_only = re.fullmatch(r"governor dashboard: (http://127\.0\.0\.1:\d+/) \(read-only\)", said[0])
            control = re.match(r"holds and reload: (http://\S+/)#token=([\w-]+) ", said[1])
            assert read_only, said
            assert control, said
            assert control.group(1) == read_only.group(1)
        except queue.Empty:
            self.stop()
            raise AssertionError("governor dashboard did not say where it listens within 30 s") from None
        except BaseException:
            self.stop()
            raise
        self.url, self.token = read_only.group(1), control.group(2)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def dashboard(live: DaemonProc) -> Iterator[Dashboard]:
    d = Dashboard(live)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (`make system-deps` installs Debian's as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Watched:
    """A page with its console errors and every URL it asked for."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def js(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def wait(self, predicate: str) -> None:
        self.page.wait_for_function(predicate, timeout=WAIT_MS)  # a function: the page's CSP forbids eval


def test_the_graph_moves_when_the_zone_heats_and_the_decision_shows_its_reason(
    live: DaemonProc, dashboard: Dashboard, browser: Any
) -> None:
    w = Watched(browser)
    w.page.goto(dashboard.url)
    w.wait("() => window.governorDashboard && window.governorDashboard.samples.length >= 3")
    assert w.page.text_content("#state") == "idle"
    assert w.js("() => window.governorDashboard.charts.temp.data[1].at(-1)") == 45.0
    assert w.js("() => window.governorDashboard.charts.temp.data[2].at(-1)") == 80.0, "the trip's line"
    assert w.page.is_hidden("#control"), "read-only without the token"
    drawn = w.js("() => document.querySelector('#chart-temp canvas').toDataURL()")

    live.tree.write(ZONE_TEMP, 90000)
    w.wait("() => document.getElementById('state').textContent === 'hot'")
    w.wait("() => window.governorDashboard.charts.temp.data[1].at(-1) === 90")
    assert w.js("() => document.querySelector('#chart-temp canvas').toDataURL()") != drawn, "the graph moved"
    states = w.js("() => window.governorDashboard.charts.state.data[1]")
    assert states[0] == 0, f"idle, then hot, on the state band: {states}"
    assert states[-1] == 3, f"idle, then hot, on the state band: {states}"

    row = w.page.locator("#decisions tbody tr").first
    cells = row.locator("td").all_text_contents()
    assert cells[1] == "hot"
    assert cells[2].startswith("thermal.")
    assert "cpu-thermal 90.0 °C" in cells[3], cells
    assert "80 °C trip" in cells[3], cells
    assert "hot: cpu-thermal 90.0 °C" in w.page.text_content("#reason")

    if os.environ.get("GOVERNOR_SCREENSHOTS"):
        w.page.wait_for_timeout(6000)  # hot for a while, then cooling: the graph comes down again
        live.tree.write(ZONE_TEMP, 70000)
        w.wait("() => window.governorDashboard.charts.temp.data[1].at(-1) === 70")
        w.page.wait_for_timeout(3000)
        (REPO / "docs" / "img").mkdir(exist_ok=True)
        w.page.screenshot(path=str(REPO / "docs" / "img" / "dashboard.png"))

    assert w.errors == []
    assert [u for u in w.requests if not u.startswith(dashboard.url)] == [], "nothing from any other host"
    w.page.close()


def test_holds_and_reload_only_with_the_token(live: DaemonProc, dashboard: Dashboard, browser: Any) -> None:
    w = Watched(browser)
    w.page.goto(f"{dashboard.url}#token={dashboard.token}")
    w.wait("() => window.governorDashboard && window.governorDashboard.control")
    assert "token" not in w.page.url, "the token leaves the address bar"

    w.page.click("#reload-button")
    w.wait("() => document.getElementById('control-said').textContent.startsWith('policy reloaded')")

    w.page.fill("input[name=max_threads]", "1")
    w.page.fill("input[name=ttl_s]", "600")
    w.page.click("#hold-button")
    w.wait("() => document.getElementById('control-said').textContent.startsWith('holding #')")
    (hold,) = eventually(lambda: list(live.status()["holds"]), interval_s=0.1)
    assert hold["max_threads"] == 1
    assert hold["owner"].startswith(f"pid {dashboard.proc.pid} ")
    assert 590 <= hold["expires_in_s"] <= 600
    release = w.page.locator("#holds button", has_text="release")
    release.wait_for(timeout=WAIT_MS)
    release.click()
    eventually(lambda: live.status()["holds"] == [], interval_s=0.1)
    w.wait("() => document.querySelectorAll('#holds tbody tr').length === 0")
    assert w.errors == []
    w.page.close()


def test_a_status_older_than_a_new_hold_does_not_end_it(live: DaemonProc) -> None:
    """The relay's status can be built a moment before a hold is added and arrive after it: that hold is kept (it
    was released at once, so the page said "holding" of a hold already gone); one the daemon really ended goes."""
    holds = Holds(live.client)
    hold_id = holds.take(_HoldRequest(max_threads=1))["hold"]
    holds.prune({"holds": []})  # a status from before the hold
    assert [h["id"] for h in live.status()["holds"]] == [hold_id]
    assert holds.ids() == [hold_id]
    holds.status_lag_s = 0.0  # from now on, a status without it means the daemon ended it
    holds.prune({"holds": []})
    assert holds.ids() == []
    eventually(lambda: live.status()["holds"] == [])


def test_without_the_token_nothing_acts_and_another_site_gets_nothing(live: DaemonProc, dashboard: Dashboard) -> None:
    with httpx.Client(base_url=dashboard.url, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert re.findall(r'(?:src|href)="([^"]+)"', page.text) == [
            "data:,", "/static/uPlot.min.css", "/static/dashboard.css", "/static/uPlot.iife.min.js",
            "/static/dashboard.js", "/static/uPlot.LICENSE",
        ]  # fmt: skip
        assert http.get("/static/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32)")
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = http.post("/api/reload", headers=headers)
            assert refused.status_code == 403
            assert refused.json()["error"] == "holds and reload need its token"
            assert http.post("/api/hold", json={"state": "idle"}, headers=headers).status_code == 403
        # A page elsewhere whose name now points at 127.0.0.1 (DNS rebinding) is not this dashboard's Host.
        assert http.get("/", headers={"Host": "evil.example:80"}).status_code == 400
        bad = http.post("/api/hold", json={"max_threads": -1}, headers={"Authorization": f"Bearer {dashboard.token}"})
        assert bad.status_code == 400
        assert "max_threads" in bad.json()["error"]
    assert live.status()["holds"] == []
