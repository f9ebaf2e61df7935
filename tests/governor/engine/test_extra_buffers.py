"""`extra_buffers`: off only where the CPU reports AMX and the library has AMX kernels (llama.cpp's AMX path crashes),
on elsewhere, or as configured; "off" really loads without AMX/repack buffers and decodes, and "on" decodes wherever
auto would be on (in child processes)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from governor.engine.extra_buffers import choose, cpu_flags, library_has_amx
from policies.ladder import LadderError, load_ladder
from sensors.root import Root
from tests.governor.engine.engine_proc import Engine, user
from tests.native import in_child, run_child

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


def _repacks_q4_0() -> bool:
    """llama.cpp repacks Q4_0 weights on x86 with AVX2 and on ARM with NEON dot products (ggml-cpu/repack.cpp)."""
    try:
        flags = cpu_flags(Root("/"))
    except OSError:
        return False
    return platform.machine() == "x86_64" and "avx2" in flags


REPACKS_Q4_0 = _repacks_q4_0()


def fake_root(tmp_path: Path, cpuinfo: str | None) -> Root:
    (tmp_path / "proc").mkdir()
    if cpuinfo is not None:
        (tmp_path / "proc" / "cpuinfo").write_text(cpuinfo * 4)  # every processor repeats its block
    return Root(tmp_path)


# What llama_print_system_info() says (llama-cpp-python 0.3.36), shortened: a -march=native build on a Sapphire
# Rapids, and the set-up's -mno-amx-* build on the same CPU.
INFO_AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
INFO_NO_AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 | "


def test_library_amx_is_read_from_llama_cpps_system_info() -> None:
    assert library_has_amx(INFO_AMX)
    assert not library_has_amx(INFO_NO_AMX)


@pytest.mark.parametrize("library_amx", [True, None], ids=["library-with-amx-kernels", "library-unknown"])
def test_auto_is_off_on_an_amx_cpu_whose_library_may_take_the_amx_path(
    tmp_path: Path, library_amx: bool | None
) -> None:
    chosen = choose("auto", fake_root(tmp_path, SAPPHIRE_RAPIDS), library_amx=library_amx)

    assert not chosen.enabled
    assert "amx_int8" in chosen.reason
    assert "amx_tile" in chosen.reason
    assert "llama.cpp #20824" in chosen.reason
    assert "make setup" in chosen.reason  # how to keep the repack
    assert str(tmp_path / "proc" / "cpuinfo") in chosen.reason  # where it looked, as given
    assert chosen.as_dict() == {"mode": "auto", "enabled": False, "reason": chosen.reason}


def test_auto_keeps_the_repack_on_an_amx_cpu_when_the_library_has_no_amx_kernels(tmp_path: Path) -> None:
    chosen = choose("auto", fake_root(tmp_path, SAPPHIRE_RAPIDS), library_amx=False)

    assert chosen.enabled
    assert "amx_int8" in chosen.reason
    assert "no AMX kernels" in chosen.reason


@pytest.mark.parametrize("cpuinfo", [EPYC, RASPBERRY_PI_5], ids=["epyc-without-amx", "arm-keeps-its-repack"])
@pytest.mark.parametrize("library_amx", [True, False, None])
def test_auto_is_on_without_amx(tmp_path: Path, cpuinfo: str, library_amx: bool | None) -> None:
    chosen = choose("auto", fake_root(tmp_path, cpuinfo), library_amx=library_amx)

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


def auto_here() -> dict[str, object]:
    """In the child: the engine's own auto decision on this machine (its CPU and the llama.cpp it loads)."""
    from governor.engine.model import extra_buffers_for

    return extra_buffers_for().as_dict()


def library_amx_here() -> bool:
    """In the child: whether the llama.cpp this venv loads has AMX kernels."""
    import llama_cpp

    return library_has_amx(llama_cpp.llama_print_system_info().decode(errors="replace"))


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

    off_buffers, text, n = in_child(load_and_decode, q4_0, False)

    assert n == 6
    assert text.strip()
    # llama.cpp's own load report: with extra buffers off, no weight went to AMX or CPU_REPACK.
    assert not {"AMX", "CPU_REPACK"} & set(off_buffers), off_buffers
    assert sum(off_buffers.values()) > 50  # the 150M model's weights, in plain CPU buffers


@pytest.mark.slow
def test_on_decodes_where_auto_is_on_and_crashes_in_its_child_where_auto_is_off(demo_ladder: Path) -> None:
    q4_0 = str(load_ladder(demo_ladder).get("large").path)
    auto = in_child(auto_here)

    if not auto["enabled"]:
        # An AMX CPU and a library with AMX kernels: "on" takes llama.cpp's AMX path, which crashes at the first decode
        # (#20824). The crash stays in its child and is named; the day it decodes, auto's reason is out of date.
        out = run_child(load_and_decode, q4_0, True)
        assert out.killed is not None, (
            f"extra buffers on decoded on this AMX CPU and library ({out.kind}: {out.value!r}): llama.cpp's AMX "
            f"path no longer crashes, so extra_buffers 'auto' ({auto['reason']}) should keep it on"
        )
        return
    on_buffers, text, n = in_child(load_and_decode, q4_0, True)
    assert n == 6
    assert text.strip()
    assert "AMX" not in on_buffers  # auto is on only where llama.cpp cannot choose its AMX buffer
    if "CPU_REPACK" not in on_buffers:
        pytest.skip(f"this CPU/build repacks nothing (on: {on_buffers}), so on and off cannot differ here")
    assert on_buffers["CPU_REPACK"] > 10


@pytest.mark.slow
def test_an_engine_on_a_fake_amx_cpu_says_why_and_serves_a_q4_0_model(demo_ladder: Path, tmp_path: Path) -> None:
    """On an AMX CPU the set-up's library (no AMX kernels) keeps extra buffers on, and a Q4_0 tier is repacked on x86;
    a library with AMX kernels (built elsewhere) turns them off."""
    library_amx = in_child(library_amx_here)
    root = fake_root(tmp_path, SAPPHIRE_RAPIDS)
    engine = Engine(
        tmp_path, "--models", str(demo_ladder), "--tier", "large", "--threads", "1", "--root", str(root.prefix)
    )
    try:
        status = engine.status()
        assert status["extra_buffers"]["enabled"] is not library_amx
        assert "amx_int8" in status["extra_buffers"]["reason"]
        if library_amx:
            assert set(status["weight_buffers_mib"]) == {"CPU_Mapped"}  # llama.cpp's report: no AMX, no CPU_REPACK
        else:
            assert "no AMX kernels" in status["extra_buffers"]["reason"]
            assert "AMX" not in status["weight_buffers_mib"]
            if REPACKS_Q4_0:
                assert status["weight_buffers_mib"]["CPU_REPACK"] > 10, status["weight_buffers_mib"]
        r = engine.chat(messages=user("the people of the world"), max_tokens=8, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        [logged] = engine.log_events("engine.extra_buffers")
        assert logged["enabled"] is status["extra_buffers"]["enabled"]
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


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86 only")
def test_the_set_ups_llama_cpp_has_no_amx_kernels() -> None:
    assert not in_child(library_amx_here), (
        "this venv's llama.cpp has AMX kernels, so auto turns extra buffers off on AMX CPUs: it was not built by "
        "`make setup` (which compiles it with -mno-amx-*); `make clean setup` rebuilds it"
    )
