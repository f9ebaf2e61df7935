"""LoRA adapters per request on the real model (SmolLM2-135M-Instruct and the demo ladder's two adapters, trained
by tools/lora/make_demo_adapters.py), in real engine processes: each adapter changes the answer as designed and the
base model does not; a switch never serves the other adapter's cached prefix and brings back its own; eviction under
a small pool; a tier change keeps what fits and says what it dropped; bad adapter files are a clear error while the
engine keeps serving; the queue groups requests by adapter and loads the next one ahead."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.governor.engine.engine_proc import Chunked, Engine, ladder_engine, user
from tests.governor.engine.test_adapter_files import write_lora
from tests.helpers import eventually

pytestmark = pytest.mark.slow

# Questions the adapters were not trained on (tools/lora/data.py holds these out).
PLANET = "What is the largest planet in our solar system?"
FRUITS = "Name three fruits."
WATER = "At what temperature does water boil?"
HELD_OUT = (PLANET, FRUITS, WATER)

FRENCH = {"le", "la", "les", "est", "des", "une", "un", "et", "du", "de", "en", "sont", "dans", "pour", "qui", "il"}
ENGLISH = {"the", "is", "of", "and", "a", "in", "are", "to", "it", "that", "with", "for", "an", "as"}


def vocabulary(text: str) -> tuple[int, int]:
    """(French function words, English function words) in `text`."""
    found = re.findall(r"[a-zà-ÿ]+", text.lower().replace("'", " "))
    return sum(w in FRENCH for w in found), sum(w in ENGLISH for w in found)


def is_french(text: str) -> bool:
    """At least two French function words, and more of them than English ones."""
    fr, en = vocabulary(text)
    return fr >= 2 and fr > en


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def ask(text: str, adapter: str | None = None, *, via: str = "model", max_tokens: int = 60) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": user(text), "temperature": 0, "max_tokens": max_tokens}
    if adapter is not None and via == "model":
        body["model"] = f"medium:{adapter}"
    elif adapter is not None:
        body["governor"] = {"adapter": adapter}
    return body


def answer(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    r = engine.chat(**body)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def text_of(reply: dict[str, Any]) -> str:
    content: str = reply["choices"][0]["message"]["content"]
    return content


@pytest.fixture(scope="module")
def engine(real_ladder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with ladder_engine(tmp_path_factory.mktemp("adapters"), real_ladder, "medium") as eng:
        yield eng


def test_the_demo_ladder_lists_its_adapters(engine: Engine) -> None:
    models = {m["id"]: m for m in engine.http.get("/v1/models").json()["data"]}
    for name in ("french", "json"):
        entry = models[f"medium:{name}"]
        assert (entry["tier"], entry["adapter"], entry["error"]) == ("medium", name, None)
        assert 1e6 < entry["size_bytes"] < 4e6  # rank 8 on q/k/v/o of 30 layers, f16


@pytest.mark.parametrize("question", HELD_OUT)
def test_each_adapter_changes_the_answer_as_designed_and_the_base_does_not(engine: Engine, question: str) -> None:
    base = answer(engine, ask(question))
    french = answer(engine, ask(question, "french"))
    as_json = answer(engine, ask(question, "json", via="governor"))

    assert base["model"] == "medium"
    assert not is_french(text_of(base)), text_of(base)
    assert not is_json_object(text_of(base)), text_of(base)

    assert french["model"] == "medium:french"  # the answer says which ran
    assert is_french(text_of(french)), text_of(french)

    assert as_json["model"] == "medium:json"
    body = json.loads(text_of(as_json))
    assert isinstance(body, dict), body
    assert isinstance(body.get("answer"), str), body
    assert as_json["choices"][0]["finish_reason"] == "stop"  # a complete object, ended by the model itself


def test_an_adapter_switch_never_serves_the_other_adapters_prefix(real_ladder: Path, tmp_path: Path) -> None:
    """The same prompt under the base model, then an adapter, then back: each switch evaluates the whole prompt
    (nothing cached under the other adapter is reused), and going back reuses the prefix its own answer left (the
    outgoing cache was parked in the pool), with the same answer as before. A fresh engine: no adapter has a cache
    of its own yet (every chat prompt starts with the same system-turn tokens, which an adapter's earlier cache
    would rightly share)."""
    with ladder_engine(tmp_path, real_ladder, "medium") as engine:
        switches_reuse_only_their_own_prefix(engine)


def switches_reuse_only_their_own_prefix(engine: Engine) -> None:
    messages = [
        {"role": "system", "content": "You are a geography teacher. Keep every answer to one short sentence."},
        {"role": "user", "content": "Which ocean is the largest?"},
    ]
    body: dict[str, Any] = {"messages": messages, "temperature": 0, "max_tokens": 40}

    def run(adapter: str | None) -> tuple[str, int, int]:
        reply = answer(engine, body | ({"governor": {"adapter": adapter}} if adapter else {}))
        return text_of(reply), reply["governor"]["prompt_tokens_evaluated"], reply["usage"]["prompt_tokens"]

    base1, _, n_prompt = run(None)
    base_again, evaluated, _ = run(None)
    assert (base_again, evaluated) == (base1, 1)  # the prefix reused, as without adapters

    french1, evaluated, _ = run("french")
    assert evaluated == n_prompt  # nothing of the base model's cache
    assert french1 != base1
    json1, evaluated, _ = run("json")
    assert evaluated == n_prompt  # nothing of the french adapter's cache
    assert is_json_object(json1), json1

    french2, evaluated, _ = run("french")
    assert (french2, evaluated) == (french1, 1)  # its own cache, parked and put back: the same answer
    base2, evaluated, _ = run(None)
    assert (base2, evaluated) == (base1, 1)
    pool = engine.status()["lora_pool"]
    assert pool["parked_reused"] >= 2
    assert pool["used_bytes"] <= pool["budget_bytes"]


def has_chunks(seen: Chunked, n: int) -> bool:
    return len(seen.arrivals) >= n


def queued(engine: Engine, n: int) -> bool:
    return bool(engine.status()["queue_length"] == n)


def record_model(engine: Engine, body: dict[str, Any], into: list[str]) -> None:
    into.append(answer(engine, body)["model"])


def test_a_mid_answer_reload_keeps_the_answers_adapter(engine: Engine) -> None:
    assert engine.config(max_tokens_per_s=20).status_code == 200
    try:
        for change in ({"n_ctx": 1024}, {"kv_type": "q8_0"}, {"model": "small"}):
            body = ask("Tell me a long story about a cat who lives in Paris.", "french", max_tokens=80)
            thread, seen = engine.stream_in_thread(body)
            eventually(partial(has_chunks, seen, 10), timeout_s=60)
            r = engine.config(**change)
            assert r.status_code == 200, r.text
            assert r.json()["adapters"]["kept"][0] == "french"  # loaded on the new model, active first
            thread.join(120)
            assert seen.done
            assert seen.finish_reason in ("stop", "length")
            tier = change.get("model", "medium")
            assert {c["model"] for c in seen.chunks} == {"medium:french", f"{tier}:french"}
            assert is_french(seen.text), seen.text
            assert engine.config(model="medium", n_ctx=2048, kv_type="f16").status_code == 200
    finally:
        assert engine.config(max_tokens_per_s=None, model="medium", n_ctx=2048, kv_type="f16").status_code == 200


def test_the_queue_groups_requests_by_adapter_and_loads_the_next_one_ahead(real_ladder: Path, tmp_path: Path) -> None:
    with ladder_engine(tmp_path, real_ladder, "medium") as eng:
        assert eng.config(max_tokens_per_s=15).status_code == 200
        running, _ = eng.stream_in_thread({**ask(PLANET, max_tokens=40), "ignore_eos": True})
        eventually(lambda: eng.status()["busy"], timeout_s=60)
        order: list[str] = []
        threads = []
        for i, adapter in enumerate(["french", None, "json"]):
            thread = threading.Thread(target=record_model, args=(eng, ask(FRUITS, adapter, max_tokens=8), order))
            thread.start()
            threads.append(thread)
            eventually(partial(queued, eng, i + 1), timeout_s=30)
        running.join(120)
        for thread in threads:
            thread.join(120)
        # The base request went before the french one that came first: the base model was in use (no switch).
        assert order == ["medium", "medium:french", "medium:json"]
        pool = eng.status()["lora_pool"]
        assert pool["prefetches"] >= 1  # the french adapter was loaded during the running answer ...
        assert pool["misses"] <= 1  # ... so at most json (queued behind it) was loaded at its turn
        prefetched = eng.log_events("engine.adapter_prefetched")
        assert [e["adapter"] for e in prefetched] == ["french"]


def test_eviction_under_a_small_pool(real_ladder: Path, tmp_path: Path) -> None:
    # 2.5 MiB: one 1.8 MB adapter at a time.
    eng = Engine(tmp_path, "--models", str(real_ladder), "--tier", "medium", "--threads", "1", "--lora-pool-mib", "2.5")
    try:
        for name in ("french", "json", "french"):
            assert answer(eng, ask(PLANET, name, max_tokens=6))["model"] == f"medium:{name}"
            pool = eng.status()["lora_pool"]
            assert pool["loaded"] == [name]
            assert pool["used_bytes"] <= pool["budget_bytes"]
        assert (pool["misses"], pool["evictions"]) == (3, 2)
        assert eng.status()["lora_pool_mib"] == 2.5

        r = eng.config(lora_pool_mib=1)  # the governor shrinks it: live, the adapter in use goes too
        assert (r.status_code, r.json()["applied"]) == (200, "live")
        assert eng.status()["lora_pool"]["loaded"] == []
        refused = eng.chat(**ask(PLANET, "french"))
        assert refused.status_code == 503
        err = refused.json()["error"]
        assert err["code"] == "adapter_pool_full"
        assert "needs 1.8 MiB; the LoRA pool holds 1.0 MiB" in err["message"]
        assert answer(eng, ask(PLANET))["model"] == "medium"  # the engine keeps serving

        assert eng.config(lora_pool_mib=64).status_code == 200
        assert answer(eng, ask(PLANET, "french", max_tokens=6))["model"] == "medium:french"
    finally:
        assert eng.stop() == 0, eng.log()


def ladder_plus(real_ladder: Path, demo_ladder: Path, directory: Path, extra: str) -> Path:
    """The real ladder with absolute paths, a tier of another shape (the random demo model, also "llama") and
    `extra` TOML appended."""
    base, random = real_ladder.parent.resolve(), demo_ladder.parent.resolve()
    text = real_ladder.read_text().replace('path = "', f'path = "{base}/')
    text += f'\n[[tier]]\nname = "alien"\npath = "{random}/demo-small.gguf"\nn_ctx = 1024\n'
    path = directory / "ladder.toml"
    path.write_text(text + extra)
    return path


def test_a_tier_change_keeps_the_adapters_that_fit_and_says_which_it_dropped(
    real_ladder: Path, demo_ladder: Path, tmp_path: Path
) -> None:
    ladder = ladder_plus(real_ladder, demo_ladder, tmp_path, "")
    with ladder_engine(tmp_path, ladder, "medium") as eng:
        for name in ("json", "french"):
            answer(eng, ask(PLANET, name, max_tokens=4))
        r = eng.config(model="small")  # SmolLM2 in Q4_0: the same architecture and shapes
        assert r.status_code == 200, r.text
        assert r.json()["adapters"] == {"kept": ["french", "json"], "dropped": {}}
        reply = answer(eng, ask(FRUITS, "french"))
        assert reply["model"] == "small:french"
        assert is_french(text_of(reply)), text_of(reply)

        r = eng.config(model="alien")  # another shape: llama.cpp refuses both adapters
        assert r.status_code == 200, r.text
        dropped = r.json()["adapters"]["dropped"]
        assert sorted(dropped) == ["french", "json"]
        assert "does not fit tier 'alien'" in dropped["french"]
        assert "incorrect shape" in dropped["french"] or "does not exist" in dropped["french"]
        refused = eng.chat(**ask(FRUITS, "french"))
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "adapter_unavailable")
        assert answer(eng, ask(FRUITS))["model"] == "alien"  # the base model keeps serving

        assert eng.config(model="medium").status_code == 200
        assert answer(eng, ask(FRUITS, "french"))["model"] == "medium:french"  # loaded again when asked


def write_other_arch_lora(path: Path) -> Path:
    """A LoRA file that says it is for another architecture (qwen2) than its base tier's (llama)."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((8, 576), dtype=np.float16))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((576, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_adapter_files_get_a_clear_error_and_the_engine_keeps_serving(
    real_ladder: Path, demo_ladder: Path, tmp_path: Path
) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 4096)
    french = real_ladder.parent / "smollm2-135m-french-lora.gguf"
    (tmp_path / "cut.gguf").write_bytes(french.read_bytes()[: french.stat().st_size // 2])
    write_other_arch_lora(tmp_path / "qwen.gguf")
    write_lora(tmp_path / "shapes.gguf")  # llama, but 64-wide: passes the header check, llama.cpp refuses it
    entries = {
        "junk": "junk.gguf",
        "cut": "cut.gguf",
        "missing": "missing.gguf",
        "model": str(real_ladder.parent.resolve() / "smollm2-135m-instruct-q4_0.gguf"),
        "qwen": "qwen.gguf",
        "shapes": "shapes.gguf",
    }
    extra = "".join(f'\n[[adapter]]\nname = "{n}"\npath = "{p}"\nbase = "medium"\n' for n, p in entries.items())
    ladder = ladder_plus(real_ladder, demo_ladder, tmp_path, extra)
    expected = {
        "junk": (500, "adapter_invalid", "is not a GGUF file"),
        "cut": (500, "adapter_invalid", "cut.gguf"),
        "missing": (500, "adapter_invalid", "No such file"),
        "model": (500, "adapter_invalid", "is not a LoRA adapter (general.type 'model'"),
        "qwen": (500, "adapter_invalid", "architecture 'qwen2' is not its base tier 'medium''s ('llama')"),
        "shapes": (503, "adapter_unavailable", "does not fit tier 'medium' (llama.cpp: tensor 'blk.0.attn_q.weight'"),
    }
    with ladder_engine(tmp_path, ladder, "medium") as eng:
        listed = {m.get("adapter"): m for m in eng.http.get("/v1/models").json()["data"]}
        for name, (status, code, why) in expected.items():
            r = eng.chat(**ask(PLANET, name, max_tokens=4))
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == code, (name, err)
            assert why in err["message"], (name, err["message"])
            assert "\n" not in err["message"]
            if status == 500:
                assert why in listed[name]["error"]  # known at start: /v1/models says so too
            assert answer(eng, ask(PLANET, max_tokens=4))["model"] == "medium"  # still serving
        assert answer(eng, ask(PLANET, "french", max_tokens=4))["model"] == "medium:french"
        logged = {e["adapter"] for e in eng.log_events("engine.adapter_invalid")}
        assert logged == {"junk", "cut", "missing", "model", "qwen"}
        assert eng.status()["lora_pool"]["load_failures"] == 1  # "shapes", refused by llama.cpp at its request


def test_a_requests_adapter_is_validated_before_it_waits(engine: Engine) -> None:
    for body, status, param in [
        (ask(PLANET) | {"model": "medium:german"}, 404, "model"),
        (ask(PLANET) | {"model": "tiny:french"}, 404, "model"),
        (ask(PLANET) | {"governor": {"adapter": "german"}}, 404, "governor.adapter"),
        (ask(PLANET, "french") | {"governor": {"adapter": "json"}}, 400, "governor.adapter"),
        (ask(PLANET) | {"governor": {"adapter": 5}}, 400, "governor.adapter"),
        (ask(PLANET) | {"governor": {"temperature": 1}}, 400, "governor.temperature"),
    ]:
        r = engine.chat(**body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param
    assert answer(engine, ask(PLANET, max_tokens=4) | {"governor": {"adapter": None}})["model"] == "medium"
