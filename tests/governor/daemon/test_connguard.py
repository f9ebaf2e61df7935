"""The public engine socket's connection bounds (governor/daemon/connguard.py)."""

from __future__ import annotations

import os
import resource

from governor.daemon.connguard import FD_RESERVE, MAX_CONNECTIONS, Guard, max_connections


def test_one_user_gets_a_quarter_and_root_the_rest_up_to_the_cap() -> None:
    guard = Guard(limit=8)
    other = 65534
    assert [guard.admit(other) for _ in range(2)] == [None, None]
    assert guard.admit(other) == f"too many connections from uid {other} (2); try again later"
    assert guard.admit(other + 1) is None  # another user has a quarter of its own
    assert [guard.admit(os.geteuid()) for _ in range(5)] == [None] * 5  # the daemon's user: only the cap
    assert guard.admit(0) == "too many connections to the engine socket (8); try again later"
    guard.release(other)
    assert guard.admit(other) is None  # a closed connection is a free place again
    assert sum(guard.by_uid.values()) == 8
    assert b"503 Service Unavailable" in guard.refuse("too many")
    assert guard.refused == 1


def test_the_cap_leaves_the_daemon_descriptors_of_its_own() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert max_connections() == min(MAX_CONNECTIONS, (1024 - FD_RESERVE) // 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        assert max_connections() == 22  # two descriptors a proxied request, after the reserve
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        assert max_connections() == 8  # never none
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
