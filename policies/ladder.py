"""The model ladder: tiers of GGUF models, largest first, each with its default engine settings.

A TOML file shared by the engine (`governor engine --models`), the policy core (memory fit, model tier) and the
daemon. Paths are relative to the ladder file.

    extra_buffers = "auto"  # llama.cpp's AMX / weight-repack buffers: auto (off only on AMX CPUs), on, off

    [[tier]]
    name = "large"
    path = "demo-large.gguf"
    n_ctx = 2048          # default and largest context for this tier
    kv_type = "f16"       # default KV-cache type

    [[adapter]]           # a LoRA adapter a request may pick ("model": "large:french"); see docs/engine.md
    name = "french"
    path = "french.gguf"  # a GGUF LoRA (llama.cpp's convert_lora_to_gguf.py)
    base = "large"        # the tier it was trained on; it also runs on every tier of the same architecture
    scale = 1.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.decision import KvType
from policies.loader import TomlFileError, load_toml_model

# llama_model_params.use_extra_bufts: "auto" is off only where the CPU reports AMX (governor.engine.extra_buffers).
ExtraBuffersMode = Literal["auto", "on", "off"]


class LadderError(TomlFileError):
    """A model ladder file that cannot be read, parsed or validated."""


class ModelTier(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    path: Path
    n_ctx: int = Field(default=2048, ge=64)
    kv_type: KvType = "f16"
    flash_attn: bool = True


# A request names an adapter as "TIER:ADAPTER": no colon in an adapter's name, and a length a log line can carry.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
ADAPTER_SCALE_MAX = 4.0  # llama.cpp takes any float; beyond a few times the trained strength an adapter only breaks
ADAPTERS_MAX = 1024


class LoraAdapter(BaseModel):
    """A LoRA adapter file for the tiers of one architecture (checked against the file by the engine at start)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=ADAPTER_NAME)
    path: Path
    base: str = Field(min_length=1)  # the tier it was trained for
    scale: float = Field(default=1.0, gt=0, le=ADAPTER_SCALE_MAX)


class ModelLadder(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    extra_buffers: ExtraBuffersMode = "auto"
    tier: tuple[ModelTier, ...] = Field(min_length=1)
    adapter: tuple[LoraAdapter, ...] = Field(default=(), max_length=ADAPTERS_MAX)

    @model_validator(mode="after")
    def _unique_names(self) -> ModelLadder:
        names = [t.name for t in self.tier]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        adapters = [a.name for a in self.adapter]
        if len(set(adapters)) != len(adapters):
            raise ValueError(f"adapter names must be unique, got {adapters}")
        for a in self.adapter:
            if a.name in names:
                raise ValueError(f"adapter {a.name!r} has a tier's name: a request's model would be ambiguous")
            if a.base not in names:
                raise ValueError(f"adapter {a.name!r}: base {a.base!r} is not a tier of this ladder ({names})")
        return self

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return self.adapter

    @property
    def tiers(self) -> tuple[ModelTier, ...]:
        """Largest first, as written in the file."""
        return self.tier

    def get(self, name: str) -> ModelTier:
        for t in self.tier:
            if t.name == name:
                return t
        raise KeyError(f"unknown model tier {name!r}; the ladder has {[t.name for t in self.tier]}")

    def smaller(self, name: str) -> ModelTier | None:
        """The next tier down, or None at the bottom."""
        names = [t.name for t in self.tier]
        i = names.index(name)
        return self.tier[i + 1] if i + 1 < len(self.tier) else None


def load_ladder(path: Path) -> ModelLadder:
    ladder = load_toml_model(path, ModelLadder, LadderError)
    base = path.parent
    return ladder.model_copy(
        update={
            "tier": tuple(t.model_copy(update={"path": (base / t.path).resolve()}) for t in ladder.tier),
            "adapter": tuple(a.model_copy(update={"path": (base / a.path).resolve()}) for a in ladder.adapter),
        }
    )
