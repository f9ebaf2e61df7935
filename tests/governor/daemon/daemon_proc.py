"""`governor run` as a real subprocess on a fake device tree and the demo ladder (not collected: no test_ prefix)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from governor.daemon.client import ControlClient
from governor.daemon.control import ControlError
from governor.engine.client import EngineClient
from tests.helpers import eventually
from tests.sensors.tree import FakeTree

INTERVAL_S = 0.5

# A policy with short ticks and debounces so the tests run in seconds; the thresholds come from the fake zone's trips.
TEST_POLICY = f"""
name = "test"
[timing]
interval_s = {INTERVAL_S}
mitigating_interval_s = 0.25
min_dwell_s = 0.5
recover_dwell_s = 1.0
recover_step_s = 0.75
[activity]
window_s = 60.0
[changes]
live_dwell_s = 0.5
model_dwell_s = 5.0
[thermal]
enter_debounce_s = 0.0
exit_debounce_s = 0.5
forecast_horizon_s = 0.0
[battery]
low_percent = 20.0
enter_debounce_s = 0.25
exit_debounce_s = 0.5
[critical]
enter_debounce_s = 0.0
[states.idle]
threads = 4
n_ctx = 1024
max_tokens_per_s = 60.0
[states.sustained]
threads = 4
n_ctx = 1024
max_tokens_per_s = 60.0
[states.hot]
threads = 2
min_threads = 1
n_ctx = 1024
max_tokens_per_s = 60.0
min_tokens_per_s = 20.0
[states.low_battery]
threads = 2
n_ctx = 1024
max_tokens_per_s = 30.0
[states.critical]
threads = 1
n_ctx = 512
model = "smallest"
max_tokens_per_s = 10.0
"""


def device_tree(root: Path) -> FakeTree:
    """A fanless box: one CPU zone with a passive trip at 80 °C, a battery at 15 % charging from mains."""
    tree = FakeTree(root)
    tree.thermal_zone(0, "cpu-thermal", 45000, trips=(("passive", 80000), ("critical", 105000)))
    tree.battery(status="Charging", capacity=15)
    tree.mains(online=1)
    tree.cpus(4)
    tree.meminfo(total_kb=16_000_000, available_kb=12_000_000)
    tree.psi(0.0, 0.0)
    return tree


class DaemonProc:
    def __init__(
        self,
        workdir: Path,
        sockdir: Path,
        ladder: Path,
        *,
        policy: str | None = None,
        config: str = "",
        env: dict[str, str] | None = None,
        tree: Callable[[Path], FakeTree] = device_tree,
    ) -> None:
        """`tree` builds the device tree under workdir/root (a restart passes `FakeTree` to keep the one there)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.tree = tree(workdir / "root")
        self.policy = workdir / "policy.toml"
        self.policy.write_text(policy if policy is not None else TEST_POLICY)
        self.config = workdir / "governor.toml"
        self.config.write_text(config or "[restart]\ninitial_s = 0.2\n")
        self.control = sockdir / "c.sock"
        self.engine_socket = sockdir / "e.sock"
        self.log_path = workdir / "daemon.log"
        argv = [
            sys.executable, "-m", "governor", "--log-json", "run",
            "--config", str(self.config),
            "--policy", str(self.policy),
            "--root", str(self.tree.root),
            "--models", str(ladder),
            "--control-socket", str(self.control),
            "--engine-socket", str(self.engine_socket),
            "--state-dir", str(workdir / "state"),
            "--no-udev",
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | (env or {}))
        self.launched = time.monotonic()
        self.not_ready: str | None = None  # why the last wait_ready gave up, for stop() to repeat
        self.client = ControlClient(self.control, timeout_s=30.0)
        self.engine = EngineClient(self.engine_socket, timeout_s=10.0)

    def status(self) -> dict[str, Any]:
        self.check_alive()
        status: dict[str, Any] = self.client.request("status")["status"]
        return status

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"governor run exited with {self.proc.returncode}:\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """The status once the engine is up and observed. Until then the control socket may be missing, or there with
        nobody listening: the daemon binds it a moment before it listens, and a run killed with -9 leaves its file
        for the next one to clear. Both are "not yet"; any other control error fails at once."""

        def ready() -> dict[str, Any]:
            self.check_alive()
            assert self.control.exists(), "no control socket yet"
            try:
                status = self.status()
            except ControlError as exc:
                refused = exc.__context__  # the OSError the client met (raised `from None`): its kind says "not yet"
                if not isinstance(refused, ConnectionRefusedError | FileNotFoundError):
                    raise
                raise AssertionError(f"control socket there, nobody listening on it yet ({refused.strerror})") from exc
            assert status["supervisor"]["ready"], "engine not ready yet"
            assert status["engine"], "engine not observed yet"
            return status

        try:
            return eventually(ready, timeout_s=timeout_s, interval_s=0.1)
        except (AssertionError, ControlError) as exc:
            self.not_ready = str(exc)
            raise AssertionError(
                f"governor run not ready {self.age_s():.1f} s after launch: {exc}\n{self.log_tail()}"
            ) from exc

    def age_s(self) -> float:
        return time.monotonic() - self.launched

    def log_tail(self, chars: int = 4000) -> str:
        log = self.log()
        return f"its log ends:\n{log[-chars:]}" if log else "its log is empty"

    def engine_threads(self) -> int:
        return self.engine.status().threads

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit code (0 after a clean phased shutdown).

        A daemon the SIGTERM kills (-15) had not installed its handlers: it was still starting, so whatever
        stopped it early (a failed wait_ready, said here again) is the error, not the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.engine.close()
        if self.proc.returncode == -signal.SIGTERM:
            why = f"; wait_ready had given up: {self.not_ready}" if self.not_ready else ""
            raise AssertionError(
                f"governor run was still starting when stopped {self.age_s():.1f} s after launch (SIGTERM killed it "
                f"before it installed its handlers){why}\n{self.log_tail()}"
            )
        return self.proc.returncode


class NotifySocket:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET.

    Read continuously on a thread, as systemd does: a datagram socket nobody reads fills up after a few messages,
    and the sender then blocks.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set() and self._receive() is not None:
            pass

    def _receive(self) -> bool | None:
        """One datagram if one comes within the socket's timeout (True), else False; None once the socket closed."""
        with self._lock:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                return False
            except OSError:
                return None
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
            return True

    def drain(self) -> list[dict[str, str]]:
        """Every message so far, including any still queued on the socket."""
        while self._receive():
            pass
        with self._lock:
            return list(self.messages)

    def fields(self) -> list[str]:
        return [key for message in self.drain() for key in message]

    def close(self) -> None:
        self._closed.set()
        self._reader.join(5.0)
        self.sock.close()
