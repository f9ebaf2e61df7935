"""A simulated device by name: a shipped one (governor/lab/devices/NAME.toml), a device file, or a random fleet device
(`fleet:SEED:INDEX[:CLASS]`, governor.lab.fleet) wherever a device file is accepted."""

from __future__ import annotations

from pathlib import Path

from governor.lab.device import DeviceSpec
from governor.lab.files import LabFileError, load_model, resolve
from governor.lab.fleet import parse_name


def load_device(name_or_file: str | Path, engine: str | None = None) -> DeviceSpec:
    """A device by name (shipped, a file or fleet:SEED:INDEX); `engine` replaces its engine's kind (llama-server)."""
    device = _load(str(name_or_file))
    if engine is None:
        return device
    return device.model_copy(
        update={"engine": device.engine.model_validate({**device.engine.model_dump(), "kind": engine})}
    )


def _load(name: str) -> DeviceSpec:
    if name.startswith("fleet:"):
        try:
            device = parse_name(name)
        except ValueError as exc:
            raise LabFileError(name, str(exc)) from None
        assert device is not None
        return device
    return load_model(resolve("devices", name), DeviceSpec)
