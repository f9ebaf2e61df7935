"""Malformed control requests to the victim daemon: each gets one JSON line saying what was wrong, and the daemon
(its loop, its control server, its engine) keeps going."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.governor.daemon.daemon_proc import DaemonProc

pytestmark = pytest.mark.slow
FAULT_KIND = "control requests"

# (id, the raw request line, a fragment of the expected error)
CASES: list[tuple[str, bytes, str]] = [
    ("not JSON", b"status please", "not JSON"),
    ("an array", b"[]", "bad request"),
    ("null", b"null", "bad request"),
    ("a string", b'"status"', "bad request"),
    ("no cmd", b"{}", 'needs a "cmd"'),
    ("cmd a number", b'{"cmd": 5}', "bad request"),
    ("unknown cmd", b'{"cmd": "fly"}', "unknown command 'fly'"),
    ("why n Infinity", b'{"cmd": "why", "n": Infinity}', "n: "),
    ("why n NaN", b'{"cmd": "why", "n": NaN}', "n: "),
    ("why n negative", b'{"cmd": "why", "n": -1}', "n: "),
    ("why n 1e400", b'{"cmd": "why", "n": 1e400}', "n: "),
    ("why n a string", b'{"cmd": "why", "n": "5"}', "n: "),
    ("why n 10**30", b'{"cmd": "why", "n": 1000000000000000000000000000000}', "n: "),
    ("why unknown field", b'{"cmd": "why", "m": 1}', "m: "),
    ("status unknown field", b'{"cmd": "status", "verbose": true}', "verbose: "),
    ("hold nothing", b'{"cmd": "hold"}', "a hold needs a state"),
    ("hold unknown state", b'{"cmd": "hold", "state": "sleepy"}', "unknown state 'sleepy'"),
    ("hold state a number", b'{"cmd": "hold", "state": 3}', "unknown state 3"),
    ("hold max_threads 0", b'{"cmd": "hold", "max_threads": 0}', "max_threads: "),
    ("hold max_threads 1e9", b'{"cmd": "hold", "max_threads": 1000000000}', "max_threads: "),
    ("hold max_threads a string", b'{"cmd": "hold", "max_threads": "2"}', "max_threads: "),
    ("hold rate Infinity", b'{"cmd": "hold", "max_tokens_per_s": Infinity}', "max_tokens_per_s: "),
    ("hold rate NaN", b'{"cmd": "hold", "max_tokens_per_s": NaN}', "max_tokens_per_s: "),
    ("hold rate 1e-300", b'{"cmd": "hold", "max_tokens_per_s": 1e-300}', "max_tokens_per_s: "),
    ("hold rate negative", b'{"cmd": "hold", "max_tokens_per_s": -1}', "max_tokens_per_s: "),
    ("hold ttl NaN", b'{"cmd": "hold", "state": "idle", "ttl_s": NaN}', "ttl_s: "),
    ("hold ttl negative", b'{"cmd": "hold", "state": "idle", "ttl_s": -5}', "ttl_s: "),
    ("hold ttl 1e400", b'{"cmd": "hold", "state": "idle", "ttl_s": 1e400}', "ttl_s: "),
    ("hold ttl over a day", b'{"cmd": "hold", "state": "idle", "ttl_s": 1000000000}', "ttl_s: "),
    ("hold a forged owner", b'{"cmd": "hold", "state": "idle", "owner": "[/]\\u001b[2J root"}', "owner: "),
    ("invalid UTF-8", b'{"cmd": "st\xff\xfeus"}', "bad request"),
    ("a NUL byte", b'{"cmd": "status\x00"}', "bad request"),
    ("deeply nested", b"[" * 50_000 + b"]" * 50_000, "bad request"),
    ("a line over 64 KiB", b'{"cmd": "' + b"s" * 70_000 + b'"}', "longer than"),
]


def ask(victim: DaemonProc, line: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(victim.control))
        sock.sendall(line + b"\n")
        answer = sock.makefile("rb").readline()
    assert answer, "no answer"
    decoded: dict[str, object] = json.loads(answer)
    return decoded


@pytest.mark.parametrize(("line", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_control_request_gets_one_clear_line(victim: DaemonProc, line: bytes, fragment: str) -> None:
    answer = ask(victim, line)
    assert answer["ok"] is False
    assert fragment in str(answer["error"]), answer
    assert "\n" not in str(answer["error"])
    status = victim.status()  # the server, the loop and the engine carry on
    assert status["holds"] == []
    assert status["errors"]["control"] == 0


def test_an_unknown_http_path_is_a_404(victim: DaemonProc) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(victim.control))
        sock.sendall(b"GET /../../etc/passwd HTTP/1.0\r\n\r\n")
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.0 404")
    victim.status()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e-300"])
def test_the_hold_command_refuses_a_bad_rate_in_one_line(victim: DaemonProc, value: str) -> None:
    """The issue's first case: `governor hold --max-tokens-per-s inf` killed the daemon."""
    argv = [sys.executable, "-m", "governor", "hold", "--control-socket", str(victim.control)]
    done = subprocess.run(
        [*argv, f"--max-tokens-per-s={value}"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "max_tokens_per_s" in done.stderr
    assert "Traceback" not in done.stderr
    assert victim.status()["holds"] == []


def test_record_to_an_unwritable_path_is_one_line(victim: DaemonProc, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "governor", "record", "--control-socket", str(victim.control), "--seconds", "1"]
    target = tmp_path / "missing" / "trace.jsonl"
    done = subprocess.run([*argv, str(target)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr == f"governor: error: {target}: cannot write: No such file or directory\n"
    victim.status()
