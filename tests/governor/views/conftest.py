"""The views' tests run against a real daemon (tests/governor/daemon's fixtures)."""

from tests.governor.daemon.conftest import daemon, sock_dir

__all__ = ["daemon", "sock_dir"]
