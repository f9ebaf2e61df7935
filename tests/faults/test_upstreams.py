"""Hostile upstreams (issue 33): a real local server misbehaving on purpose behind a routing daemon whose device is
hot (so every chat goes upstream first). A valid answer in any framing RFC 9112 allows (close-delimited, chunked with
trailers, after a 1xx) is relayed; a malformed, oversized or silent one is refused before anything reaches the
client and the device answers instead, naming the upstream and why; the key never shows, in any encoding; the
daemon stays under 150 MB. Plus the upstream configurations that must be refused at load, in one line."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from governor.daemon.config import ConfigError, Upstream, load_config
from governor.daemon.routing import RoutingError, read_key
from tests.faults.hostile import GOOD, KEY, MODES, HostileUpstream
from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc
from tests.governor.daemon.test_routing import hot_tree
from tests.helpers import eventually

FAULT_KIND = "hostile upstreams"
MAX_DAEMON_BYTES = 150 * 2**20
# Hot caps the rate at 20-60 tok/s, under the 100 tok/s target: off the device, and a fallback answers in a moment.
POLICY = TEST_POLICY + "[slo]\nmin_tokens_per_s = 100.0\nback_margin = 0.1\nback_after_s = 0.5\n"
KEY_FORMS = (KEY, quote(KEY, safe=""), KEY.replace("/", "\\/"), base64.b64encode(f"Bearer {KEY}".encode()).decode())


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory, demo_ladder: Path) -> Iterator[tuple[DaemonProc, HostileUpstream]]:
    work = tmp_path_factory.mktemp("hostile")
    upstream = HostileUpstream()
    key_file = work / "lan.key"
    key_file.write_text(KEY + "\n")
    config = "\n".join(
        [
            "request_hold_s = 2.0",
            "[restart]",
            "initial_s = 0.2",
            "[[upstream]]",
            'name = "lan"',
            f'base_url = "http://127.0.0.1:{upstream.port}/v1"',
            f'api_key_file = "{key_file}"',
            "timeout_s = 2.0",
            "retry_after_s = 0.0",  # a failed upstream is tried again at the next request
        ]
    )
    sockets = Path(tempfile.mkdtemp(prefix="gvu", dir="/tmp"))
    d = DaemonProc(work / "d", sockets, demo_ladder, policy=POLICY, config=config + "\n", tree=hot_tree)
    try:
        d.wait_ready()
        eventually(lambda: d.status()["routing"]["off_device"], timeout_s=30)
        yield d, upstream
    finally:
        d.stop()
        upstream.close()
        shutil.rmtree(sockets, ignore_errors=True)


def ask(d: DaemonProc, *, stream: bool) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.engine_socket)), timeout=60) as http:
        return http.post("http://engine/v1/chat/completions", json=body)


def peak_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_hostile_upstream_answer(routed: tuple[DaemonProc, HostileUpstream], mode: str) -> None:
    d, upstream = routed
    upstream.mode = mode
    stream = mode.startswith("SSE") or "SSE" in mode or "events" in mode
    answer = ask(d, stream=stream)
    assert answer.status_code == 200, answer.text[:300]
    route = answer.headers["x-governor-route"]
    if mode in GOOD:  # relayed whole, once
        assert route == "upstream:lan", answer.text[:300]
        assert "from upstream" in answer.text
        if stream:
            assert answer.text.count("data: [DONE]") == 1, answer.text
            assert "upstream_failed" not in answer.text
    else:  # refused before anything was sent: the device answered, naming the upstream and why
        assert route == "local", answer.text[:300]
        why = answer.text if stream else answer.json()["governor"]["why"]
        assert "upstream lan failed before the first token" in why, why
    seen = json.dumps(d.status()) + json.dumps(d.client.request("why", n=50)) + d.client.request("metrics")["text"]
    for shown in (answer.text, seen, d.log()):
        for form in KEY_FORMS:
            assert form not in shown  # the key, in no encoding
    assert peak_bytes(d.proc.pid) < MAX_DAEMON_BYTES
    d.check_alive()


BAD_URLS = [
    ("port 99999", "http://127.0.0.1:99999/v1"),
    ("port 0", "http://127.0.0.1:0/v1"),
    ("port not a number", "http://127.0.0.1:eighty/v1"),
    ("CRLF in the host", "http://exa\r\nmple/v1"),
    ("a space in the host", "http://exa mple/v1"),
    ("a tab", "http://example\t/v1"),
    ("a NUL byte", "http://example\x00/v1"),
    ("a percent-encoded slash in the host", "http://ex%2Fample/v1"),
    ("no host", "http:///v1"),
    ("ftp scheme", "ftp://example/v1"),
    ("credentials in the URL", "http://user:pw@example/v1"),
    ("a query", "http://example/v1?key=1"),
]


@pytest.mark.parametrize("url", [u[1] for u in BAD_URLS], ids=[u[0] for u in BAD_URLS])
def test_a_broken_upstream_url_is_refused_at_load(tmp_path: Path, url: str) -> None:
    path = tmp_path / "governor.toml"
    path.write_text(f'[[upstream]]\nname = "lan"\nbase_url = {json.dumps(url)}\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "base_url" in str(refused.value)
    assert "\n" not in str(refused.value)


test_a_broken_upstream_url_is_refused_at_load.fault_kind = "upstream configuration"  # type: ignore[attr-defined]


def fifo(path: Path) -> None:
    os.mkfifo(path)


KEY_FILES: list[tuple[str, Any]] = [
    ("a FIFO", fifo),
    ("a directory", lambda path: path.mkdir()),
    ("/dev/zero", lambda path: path.symlink_to("/dev/zero")),
    ("missing", lambda path: None),
    ("empty", lambda path: path.write_text("")),
    ("two lines", lambda path: path.write_text("a\nb\n")),
    ("1 MB", lambda path: path.write_text("k" * 2**20)),
]


@pytest.mark.parametrize("make", [k[1] for k in KEY_FILES], ids=[k[0] for k in KEY_FILES])
def test_a_bad_api_key_file_is_one_line_and_never_blocks(tmp_path: Path, make: Any) -> None:
    path = tmp_path / "lan.key"
    make(path)
    upstream = Upstream(name="lan", base_url="http://localhost/v1", api_key_file=path)
    with pytest.raises(RoutingError) as refused:
        read_key(upstream, {})
    assert "api_key_file" in str(refused.value)


test_a_bad_api_key_file_is_one_line_and_never_blocks.fault_kind = "upstream configuration"
