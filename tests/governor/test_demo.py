"""`governor demo-models`: the ladder of random-weight GGUF models, loaded for real by llama.cpp."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from governor.demo import models as demo
from policies.ladder import load_ladder
from tests.native import in_child

GGML_TYPE_Q8_0 = 8


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ladder_lists_three_tiers_largest_first_with_clearly_different_sizes(demo_ladder: Path) -> None:
    ladder = load_ladder(demo_ladder)

    assert [t.name for t in ladder.tiers] == ["large", "medium", "small"]
    sizes = [t.path.stat().st_size for t in ladder.tiers]
    assert sizes[0] > 1.5 * sizes[1] > 3 * sizes[2]
    assert all(t.path.parent == demo_ladder.parent for t in ladder.tiers)
    assert 'path = "demo-large.gguf"' in demo_ladder.read_text()  # relative, so the directory can move


def test_each_model_says_it_is_random_and_carries_a_llama_spm_vocab(demo_ladder: Path) -> None:
    for tier in load_ladder(demo_ladder).tiers:
        fields = gguf.GGUFReader(tier.path).fields
        name = fields["general.name"].contents()
        assert "random weights" in name
        assert "gibberish" in fields["general.description"].contents()
        assert fields["general.architecture"].contents() == "llama"
        assert fields["tokenizer.ggml.model"].contents() == "llama"
        tokens = fields["tokenizer.ggml.tokens"].contents()
        assert "<0x0A>" in tokens
        assert tokens[demo.EOS_ID] == "<|im_end|>"
        assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()


def test_parameter_counts_are_about_5m_40m_150m() -> None:
    counts = {m.tier: m.n_params / 1e6 for m in demo.DEMO_MODELS}
    assert 4 <= counts["small"] <= 6
    assert 35 <= counts["medium"] <= 45
    assert 140 <= counts["large"] <= 160


def demo_models(*args: str) -> subprocess.CompletedProcess[str]:
    """`governor demo-models ARGS` in a child (writing quantizes with llama.cpp)."""
    cmd = [sys.executable, "-m", "governor", "demo-models", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def generates_with_a_q8_0_kv_cache(path: Path) -> None:
    """In the child: loaded as the engine loads (its extra-buffers decision for this CPU: AMX, repack)."""
    from governor.engine.model import open_llama

    llm = open_llama(
        path,
        n_ctx=256,
        n_threads=1,
        flash_attn=True,
        type_k=GGML_TYPE_Q8_0,
        type_v=GGML_TYPE_Q8_0,
        verbose=False,
    )
    try:
        out = llm.create_completion("the people of the world", max_tokens=8, temperature=0.0)
        # At least 8: llama-cpp-python counts one more when the last token ends inside a UTF-8 character.
        assert out["usage"]["completion_tokens"] >= 8  # type: ignore[index]
        assert out["choices"][0]["text"].strip()  # type: ignore[index]
        # Word pieces, not bytes: the SentencePiece merges work.
        assert len(llm.tokenize(b"the people of the world", add_bos=False)) == 5
    finally:
        llm.close()


@pytest.mark.parametrize("tier", ["large", "medium", "small"])
def test_model_generates_with_a_q8_0_kv_cache_and_flash_attention(demo_ladder: Path, tier: str) -> None:
    in_child(generates_with_a_q8_0_kv_cache, load_ladder(demo_ladder).get(tier).path)


def renders_chatml_with_special_tokens(path: Path) -> None:
    """In the child."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from governor.engine.model import open_llama

    llm = open_llama(path, n_ctx=128, n_threads=1, verbose=False)
    try:
        fmt = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="<s>")
        prompt = fmt(messages=[{"role": "user", "content": "hello"}]).prompt
        assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        ids = llm.tokenize(prompt.encode(), special=True)
        assert ids.count(3) == 2  # <|im_start|> is one control token, not characters
        assert demo.EOS_ID in ids
    finally:
        llm.close()


def test_chat_template_renders_chatml_with_special_tokens(demo_ladder: Path) -> None:
    in_child(renders_chatml_with_special_tokens, load_ladder(demo_ladder).get("small").path)


def test_files_are_the_same_every_time(demo_ladder: Path, tmp_path: Path) -> None:
    small = next(m for m in demo.DEMO_MODELS if m.tier == "small")  # F16: written without llama.cpp
    demo.write_model(small, tmp_path / small.filename)
    assert sha256(tmp_path / small.filename) == sha256(demo_ladder.parent / small.filename)


@pytest.mark.parametrize(("flags", "says"), [(["--random"], "gibberish"), ([], "SmolLM2-135M-Instruct")])
def test_a_second_run_does_nothing_and_says_so(
    demo_ladder: Path, real_ladder: Path, flags: list[str], says: str
) -> None:
    directory = (demo_ladder if flags else real_ladder).parent
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}

    done = demo_models(*flags, "--dir", str(directory))

    assert done.returncode == 0, done.stderr
    assert "already there" in done.stdout
    assert says in done.stdout
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before


def test_an_unwritable_directory_is_one_clear_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    done = demo_models("--random", "--dir", str(blocker / "models"))

    assert done.returncode == 2
    err = done.stderr.strip()
    assert err.startswith(f"governor: error: demo models in {blocker / 'models'}: cannot create the directory")
    assert "\n" not in err


@pytest.mark.slow
def test_concurrent_writers_replace_an_older_generation(demo_ladder: Path, tmp_path: Path) -> None:
    target = tmp_path / "models"
    target.mkdir()
    (target / demo.STAMP_NAME).write_text("governor demo-models generator 0\n")
    (target / demo.LADDER_NAME).write_text("stale")
    (target / "mine.txt").write_text("a user's file")
    cmd = [sys.executable, "-m", "governor", "demo-models", "--random", "--dir", str(target)]

    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]

    assert [p.returncode for p in procs] == [0, 0], results
    assert demo.is_current(target)
    for name in [demo.LADDER_NAME, *(m.filename for m in demo.DEMO_MODELS)]:
        assert sha256(target / name) == sha256(demo_ladder.parent / name), name
    assert (target / "mine.txt").read_text() == "a user's file"
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".demo-models-tmp")) == []
