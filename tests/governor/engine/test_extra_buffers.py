"""`extra_buffers`: off only where the CPU reports AMX (llama.cpp's AMX path crashes), on elsewhere, or as configured;
and "off" really loads without AMX/repack buffers and decodes (in a child process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.engine.extra_buffers import choose, cpu_flags
from policies.ladder import LadderError, load_ladder
from sensors.root import Root
from tests.governor.engine.engine_proc import Engine, user
from tests.native import in_child

# The first processor block of /proc/cpuinfo on an AWS m7i (Sapphire Rapids), shortened, and on this AMD EPYC / a Pi 5.
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu vme de pse tsc msr avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
bugs\t\t: spectre_v1
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr avx2 avx512f avx512_vnni avx512_bf16
"""
RASPBERRY_PI_5 = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
"""


def fake_root(tmp_path: Path, cpuinfo: str | None) -> Root:
    (tmp_path / "proc").mkdir()
    if cpuinfo is not None:
        (tmp_path / "proc" / "cpuinfo").write_text(cpuinfo * 4)  # every processor repeats its block
    return Root(tmp_path)


def test_auto_is_off_on_an_amx_cpu_and_says_why(tmp_path: Path) -> None:
    chosen = choose("auto", fake_root(tmp_path, SAPPHIRE_RAPIDS))

    assert not chosen.enabled
    assert "amx_int8" in chosen.reason
    assert "amx_tile" in chosen.reason
    assert "llama.cpp #20824" in chosen.reason
    assert str(tmp_path / "proc" / "cpuinfo") in chosen.reason  # where it looked, as given
    assert chosen.as_dict() == {"mode": "auto", "enabled": False, "reason": chosen.reason}


@pytest.mark.parametrize("cpuinfo", [EPYC, RASPBERRY_PI_5], ids=["epyc-without-amx", "arm-keeps-its-repack"])
def test_auto_is_on_without_amx(tmp_path: Path, cpuinfo: str) -> None:
    chosen = choose("auto", fake_root(tmp_path, cpuinfo))

    assert chosen.enabled
    assert chosen.reason.startswith("auto: no AMX")


def test_an_unreadable_cpuinfo_is_named_and_assumed_without_amx(tmp_path: Path) -> None:
    chosen = choose("auto", fake_root(tmp_path, None))

    assert chosen.enabled
    assert "unreadable (ENOENT" in chosen.reason


@pytest.mark.parametrize(("mode", "enabled"), [("on", True), ("off", False)])
def test_an_explicit_mode_beats_the_cpu(tmp_path: Path, mode: str, enabled: bool) -> None:
    root = fake_root(tmp_path, SAPPHIRE_RAPIDS if enabled else EPYC)
    chosen = choose(mode, root)  # type: ignore[arg-type]

    assert chosen.enabled is enabled
    assert "as configured" in chosen.reason


def test_only_flags_lines_count(tmp_path: Path) -> None:
    text = "model name\t: amx_int8 lookalike\nflags\t\t: avx2 amx_bf16\n"
    assert cpu_flags(fake_root(tmp_path, text)) == {"avx2", "amx_bf16"}


def test_the_ladder_takes_extra_buffers_and_refuses_a_typo(tmp_path: Path) -> None:
    ladder = tmp_path / "ladder.toml"
    ladder.write_text('extra_buffers = "off"\n[[tier]]\nname = "a"\npath = "a.gguf"\n')
    assert load_ladder(ladder).extra_buffers == "off"

    ladder.write_text('extra_buffers = "maybe"\n[[tier]]\nname = "a"\npath = "a.gguf"\n')
    with pytest.raises(LadderError, match=r"ladder.toml:1: extra_buffers"):
        load_ladder(ladder)


def load_and_decode(path: str, extra_buffers: bool) -> tuple[dict[str, float], str, int]:
    """In the child: the engine's model loader, then a short greedy answer."""
    from governor.engine.config import single_model
    from governor.engine.model import LoadedModel
    from policies.decision import EngineConfig

    spec = next(iter(single_model(Path(path), 256).values()))
    model = LoadedModel(
        spec,
        EngineConfig(model=spec.name, n_ctx=256, kv_type="f16", threads=1, max_tokens_per_s=None),
        extra_buffers=extra_buffers,
    )
    try:
        tokens = model.encode(model.render([{"role": "user", "content": "the people of the world"}]), prompt=True)
        gen = model.generate(tokens, {"temp": 0.0}, 1)
        out = [next(gen) for _ in range(6)]
        gen.close()
        return model.weight_buffers_mib, b"".join(model.token(t)[1] for t in out).decode(errors="replace"), len(out)
    finally:
        model.close()


@pytest.mark.slow
def test_off_loads_a_quantized_model_without_extra_buffers_and_decodes(demo_ladder: Path) -> None:
    q4_0 = str(load_ladder(demo_ladder).get("large").path)  # Q4_0: the type llama.cpp repacks on x86 and ARM

    on_buffers, _, _ = in_child(load_and_decode, q4_0, True)
    off_buffers, text, n = in_child(load_and_decode, q4_0, False)

    assert n == 6
    assert text.strip()
    # llama.cpp's own load report: with extra buffers off, no weight went to AMX or CPU_REPACK.
    assert not {"AMX", "CPU_REPACK"} & set(off_buffers), off_buffers
    assert sum(off_buffers.values()) > 50  # the 150M model's weights, in plain CPU buffers
    if "CPU_REPACK" not in on_buffers:
        pytest.skip(f"this CPU/build repacks nothing (on: {on_buffers}), so on and off cannot differ here")
    assert on_buffers["CPU_REPACK"] > 10


@pytest.mark.slow
def test_an_engine_on_a_fake_amx_cpu_says_why_and_serves_a_q4_0_model(demo_ladder: Path, tmp_path: Path) -> None:
    root = fake_root(tmp_path, SAPPHIRE_RAPIDS)
    engine = Engine(
        tmp_path, "--models", str(demo_ladder), "--tier", "large", "--threads", "1", "--root", str(root.prefix)
    )
    try:
        status = engine.status()
        assert status["extra_buffers"]["enabled"] is False
        assert "amx_int8" in status["extra_buffers"]["reason"]
        assert set(status["weight_buffers_mib"]) == {"CPU_Mapped"}  # llama.cpp's report: no AMX, no CPU_REPACK
        r = engine.chat(messages=user("the people of the world"), max_tokens=8, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        [logged] = engine.log_events("engine.extra_buffers")
        assert logged["enabled"] is False
        assert logged["reason"] == status["extra_buffers"]["reason"]
    finally:
        assert engine.stop() == 0, engine.log()


@pytest.mark.slow
def test_the_flag_beats_the_ladder(demo_ladder: Path, tmp_path: Path) -> None:
    base = demo_ladder.parent.resolve()
    ladder = tmp_path / "ladder.toml"
    ladder.write_text('extra_buffers = "off"\n' + demo_ladder.read_text().replace('path = "', f'path = "{base}/'))
    engine = Engine(tmp_path, "--models", str(ladder), "--tier", "small", "--threads", "1", "--extra-buffers", "on")
    try:
        assert engine.status()["extra_buffers"]["mode"] == "on"
        assert engine.status()["extra_buffers"]["enabled"] is True
    finally:
        assert engine.stop() == 0, engine.log()
