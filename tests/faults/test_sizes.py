"""Sizes and slow clients (issue 33): request heads of 64 MB on the public socket (one, then sixteen at once from
another user) get 431 and the daemon stays under 150 MB; a client dripping a byte at a time is closed at the
documented 5 s, on the control socket and the public one alike; and the small ones: a hold on a tier the ladder does
not have, a policy naming a path as its model or carrying escape codes in its name."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from governor.daemon.control import READ_TIMEOUT_S, ControlError
from tests.faults.conftest import opened_to_others
from tests.faults.test_upstreams import MAX_DAEMON_BYTES, peak_bytes
from tests.governor.daemon.daemon_proc import TEST_POLICY, DaemonProc

pytestmark = pytest.mark.slow
FAULT_KIND = "sizes and slow clients"
HEADER_MB = 64

HEADER_FLOOD = """
import os, socket, sys, threading
os.setgid(65534); os.setuid(65534)  # another local user, let onto the socket as a group member would be
answers = []
def one():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    try:
        s.sendall(b"GET /v1/models HTTP/1.1\\r\\nHost: e\\r\\nX-Big: ")
        for _ in range(int(sys.argv[2])):
            s.sendall(b"a" * (1 << 20))
        s.sendall(b"\\r\\n\\r\\n")
    except OSError:
        pass  # closed on us after the 431: what it answered is what counts
    answers.append(s.recv(100))
threads = [threading.Thread(target=one) for _ in range(int(sys.argv[3]))]
for t in threads: t.start()
for t in threads: t.join()
print(" ".join(a[:12].decode(errors="replace").replace(" ", "_") for a in answers), flush=True)
"""


def flood(victim: DaemonProc, connections: int) -> list[str]:
    with opened_to_others(victim.engine_socket):
        argv = [sys.executable, "-c", HEADER_FLOOD, str(victim.engine_socket), str(HEADER_MB), str(connections)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.split()


def test_one_64_mb_request_header_is_a_431(victim: DaemonProc) -> None:
    assert flood(victim, 1) == ["HTTP/1.1_431"]
    assert peak_bytes(victim.proc.pid) < MAX_DAEMON_BYTES
    victim.check_alive()


def test_sixteen_64_mb_headers_from_another_user_leave_the_daemon_small(victim: DaemonProc) -> None:
    assert flood(victim, 16) == ["HTTP/1.1_431"] * 16
    assert peak_bytes(victim.proc.pid) < MAX_DAEMON_BYTES  # the peak, not only what it kept
    assert victim.engine.status().model


def dripped_for(path: Path, first: bytes, drip: bytes) -> float:
    """Seconds until the server closes a connection that sends `first`, then one byte of `drip` every 0.5 s."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        began = time.monotonic()
        s.sendall(first)
        s.settimeout(0.5)
        for byte in drip * 100:
            try:
                s.sendall(bytes([byte]))
                if s.recv(65536) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        return time.monotonic() - began


@pytest.mark.parametrize(
    ("first", "drip"),
    [(b"", b'{"cmd": "status"}'), (b"GET /metrics HTTP/1.1\r\n", b"X-Slow: yes\r\n")],
    ids=["a control request line a byte at a time", "GET /metrics with slow header lines"],
)
def test_a_dripping_control_client_is_closed_at_the_read_timeout(victim: DaemonProc, first: bytes, drip: bytes) -> None:
    assert dripped_for(victim.control, first, drip) < READ_TIMEOUT_S + 2.0  # it would drip for 50 s


def test_a_dripping_public_client_is_closed_at_the_read_timeout(victim: DaemonProc) -> None:
    assert dripped_for(victim.engine_socket, b"GET /v1/models HTTP/1.1\r\n", b"X-Slow: yes\r\n") < READ_TIMEOUT_S + 2


def test_a_hold_on_a_tier_the_ladder_lacks_is_refused(victim: DaemonProc) -> None:
    with pytest.raises(ControlError, match="no tier 'nonexistent'"):
        victim.client.request("hold", max_tier="nonexistent")
    assert victim.status()["errors"]["control"] == 0  # a refusal, not an internal error
    assert victim.status()["holds"] == []


@pytest.mark.parametrize(
    ("policy", "word"),
    [
        (TEST_POLICY.replace("[states.critical]\n", '[states.critical]\nmodel = "../../etc/passwd"\n'), "model"),
        (TEST_POLICY.replace('name = "test"', 'name = "evil\\u001b[2J\\u001b[31m"'), "name"),
    ],
    ids=["model a path", "name with escape codes"],
)
def test_policy_check_refuses_what_reload_would(tmp_path: Path, policy: str, word: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(policy.replace('model = "smallest"\n', "", 1) if "passwd" in policy else policy)
    argv = [sys.executable, "-m", "governor", "policy", "check", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert word in done.stderr
    assert "\x1b" not in done.stdout + done.stderr
