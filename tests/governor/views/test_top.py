"""`governor top` against a real daemon on a fake device tree: its frames as text at 80x24 and 200x50 (snapshots),
the same glyphs with and without colour, and the full-screen view in a terminal, which quits on `q` and gives the
terminal back as it found it.

GOVERNOR_UPDATE_SNAPSHOTS=1 rewrites the snapshots; GOVERNOR_SCREENSHOTS=1 writes docs/img/top.svg (the README's).
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import selectors
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

from governor.daemon.client import ControlClient
from governor.views.feed import Feed
from governor.views.top import TopView
from tests.governor.daemon.daemon_proc import DaemonProc
from tests.governor.views.conftest import ZONE_TEMP
from tests.helpers import eventually

pytestmark = pytest.mark.slow

SNAPSHOTS = Path(__file__).with_name("snapshots")
REPO = Path(__file__).resolve().parents[3]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def mask(text: str) -> str:
    """What changes from run to run (the clock, ages, the engine's RSS) as placeholders."""
    text = re.sub(r"\d\d:\d\d:\d\d", "HH:MM:SS", text)
    text = re.sub(r"\(\d+(\.\d+)? (s|min|h) ago\)", "(AGE)", text)
    text = re.sub(r" +updated \d+ s ago", "  updated N s ago", text)
    return re.sub(r"RSS \d+ MiB", "RSS N MiB", text)


def top_frames(daemon: DaemonProc, width: int, height: int, frames: int = 3) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(
        [sys.executable, "-m", "governor", "top", "--frames", str(frames), "--control-socket", str(daemon.control)],
        env=env | {"COLUMNS": str(width), "LINES": str(height), "TERM": "xterm-256color"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(("width", "height"), [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_a_frame_from_the_live_stream_matches_its_snapshot(live: DaemonProc, width: int, height: int) -> None:
    out = top_frames(live, width, height)
    lines = out.splitlines()
    assert not ANSI.search(out), "no terminal: no colour and no cursor movement"
    assert len(lines) <= height
    assert max(cell_len(line) for line in lines) <= width
    assert "cpu-thermal  45.0 °C  trip 80 °C  forecast 45.0 °C" in out
    assert "battery 15 % charging" in out
    path = SNAPSHOTS / f"top-{width}x{height}.txt"
    if os.environ.get("GOVERNOR_UPDATE_SNAPSHOTS"):
        path.write_text(mask(out))
    assert mask(out) == path.read_text(), f"governor top at {width}x{height} differs from {path.name}:\n{out}"


def _feed(daemon: DaemonProc, lines: int, then: Callable[[], object] | None = None, more: int = 0) -> Feed:
    """A Feed of `lines` stream lines; with `then`: then() and `more` lines once the daemon is hot."""
    feed = Feed()
    with ControlClient(daemon.control).watch() as watch, selectors.DefaultSelector() as sel:
        sel.register(watch, selectors.EVENT_READ)

        def read() -> None:
            assert sel.select(10.0), "no watch line in 10 s"
            for line in watch.lines():
                feed.add(line)

        feed.start(watch.first)
        while feed.samples <= lines:
            read()
        if then is not None:
            then()
            deadline = feed.samples + 30
            while feed.status.get("state") != "hot":
                assert feed.samples < deadline, "not hot after 30 lines"
                read()
            hot_at = feed.samples
            while feed.samples < hot_at + more:
                read()
    return feed


def test_colour_only_repeats_what_the_glyphs_say(live: DaemonProc) -> None:
    view = TopView(_feed(live, 2))
    now = time.time()

    def render(console: Console) -> str:
        with console.capture() as captured:
            console.print(view.frame(100, 30, now))
        return captured.get()

    coloured = render(Console(width=100, height=30, force_terminal=True, color_system="truecolor"))
    plain = render(Console(width=100, height=30, color_system=None))
    assert ANSI.search(coloured), "a colour terminal gets colour"
    assert ANSI.sub("", coloured) == plain


def test_top_in_a_terminal_is_full_screen_and_quits_on_q(live: DaemonProc) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    before = termios.tcgetattr(slave)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "governor", "top", "--control-socket", str(live.control)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    screen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        eventually(lambda: b"decisions" in screen and b"cpu-thermal" in screen, timeout_s=30)
        os.write(master, b"q")
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        after = termios.tcgetattr(slave)
        os.close(slave)
        reader.join(5)
        os.close(master)
    out = bytes(screen)
    assert b"\x1b[?1049h" in out, "the alternate screen, as htop uses"
    assert out.rstrip().endswith(b"\x1b[?1049l") or b"\x1b[?1049l" in out[-200:], "and back to the shell's screen"
    assert re.search(rb"\x1b\[[0-9;]*3[0-9;]*m", out), "colour in a colour terminal"
    assert after[3] == before[3], "echo and line editing restored"


def test_a_hot_device_shows_the_bars_over_the_trip(live: DaemonProc) -> None:
    """Last in the module: it heats the zone. Also writes the README's screenshot when asked to."""
    feed = _feed(live, 4, then=lambda: live.tree.write(ZONE_TEMP, 90000), more=8)
    lines = TopView(feed).lines(100, 30, time.time())
    text = "\n".join(line.plain for line in lines)
    assert "HOT" in text.splitlines()[0]
    assert "cpu-thermal  90.0 °C  trip 80 °C" in text
    trip_row = next(line.plain for line in lines if line.plain.startswith("   80 ┤"))
    assert trip_row.endswith("█" * 5), f"the newest bars cross the trip's row:\n{text}"
    assert "╌" in trip_row, "the trip's row is dashed where no bar reaches it"
    band = next(line.plain for line in lines if line.plain.startswith("state │"))
    assert band.rstrip().endswith("HHHH"), band
    assert "iiii" in band, "the state band remembers the cool samples"
    assert any("hot" in d["state"] and "°C" in d["reason"] for d in feed.decisions)
    if os.environ.get("GOVERNOR_SCREENSHOTS"):
        console = Console(width=100, record=True, file=io.StringIO(), force_terminal=True, color_system="truecolor")
        console.print(TopView(feed).frame(100, 30, time.time()))
        svg = console.export_svg(title="governor top")
        svg = re.sub(r"@font-face\s*\{.*?\}", "", svg, flags=re.DOTALL)  # rich's fonts come from a CDN: none here
        (REPO / "docs" / "img").mkdir(exist_ok=True)
        (REPO / "docs" / "img" / "top.svg").write_text(svg)
