from __future__ import annotations

import socket
import uuid

from governor.daemon.notify import Notifier
from tests.governor.daemon.daemon_proc import NotifySocket


def test_messages_reach_the_notify_socket(notify_socket: NotifySocket) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    notifier.ready("idle: nothing to do")
    notifier.status("hot: 80 °C")
    notifier.watchdog(0.0)
    notifier.reloading()
    notifier.stopping()
    messages = notify_socket.drain()
    assert messages[0]["READY"] == "1"
    assert messages[0]["STATUS"] == "idle: nothing to do"
    assert messages[1] == {"STATUS": "hot: 80 °C"}
    assert messages[2] == {"WATCHDOG": "1"}
    assert messages[3]["RELOADING"] == "1"
    assert int(messages[3]["MONOTONIC_USEC"]) > 0
    assert messages[4]["STOPPING"] == "1"


def test_abstract_socket_is_spelled_with_an_at() -> None:
    name = f"governor-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send(STATUS="abstract")
        assert sock.recv(100) == b"STATUS=abstract"


def test_watchdog_pings_at_half_the_interval(notify_socket: NotifySocket) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "10000000"})
    assert notifier.watchdog_interval_s == 5.0
    for t in (0.0, 1.0, 4.9, 5.0, 6.0, 10.5):
        notifier.watchdog(t)
    assert notify_socket.fields() == ["WATCHDOG", "WATCHDOG", "WATCHDOG"]


def test_watchdog_for_another_pid_is_not_ours(notify_socket: NotifySocket) -> None:
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    assert Notifier(env).watchdog_interval_s is None


def test_without_systemd_nothing_is_sent() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.send(READY=1)


def test_a_vanished_socket_is_logged_not_raised(
    notify_socket: NotifySocket, captured_logs: list[dict[str, object]]
) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(notify_socket.path) + ".gone"})
    assert not notifier.send(READY=1)
    assert captured_logs[-1]["event"] == "sd_notify failed"
