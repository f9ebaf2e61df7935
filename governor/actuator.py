"""How a decision reaches the device: every actuator looks alike (tuned's plugins), and the loop applies them in one
ordered list after each decision (governor.loop.GovernorLoop).

- `apply(decision)`: make the device follow the decision's part this actuator owns. Called every tick, so it does
  nothing when nothing changed, never blocks the loop for long, and never raises for a device that refuses (it says so
  in `status()` instead).
- `restore()`: put back what it found before its first write (the daemon's restore phase, in reverse order; an
  actuator that writes outside the process saves the originals first, governor.daemon.originals, so the next start
  puts them back after a crash).
- `status()`: what is in force and why, for `governor status` (`actuators.<name>`).

Adding one: a class in one file, one line where the daemon's list is built (governor.daemon.app.build), and its
simulated twin where the lab's is (governor.lab.experiment.simulate) when the lab should model it.
"""

from __future__ import annotations

from typing import Any, Protocol

from policies.decision import Decision


class Actuator(Protocol):
    @property
    def name(self) -> str: ...

    def apply(self, decision: Decision) -> None: ...

    def restore(self) -> None: ...

    def status(self) -> dict[str, Any]: ...
