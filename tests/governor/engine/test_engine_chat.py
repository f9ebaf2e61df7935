"""Prompt fitting, stop sequences and request validation; the model's tokenizer and template on the small demo model,
loaded in a child process (tests/native.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pydantic import ValidationError

from governor.engine.chat import ChatRequest, PromptTooLong, TextStream, fit
from governor.engine.config import ConfigRefused, models_from_ladder, resolve
from policies.decision import EngineConfig
from policies.ladder import load_ladder
from tests.native import in_child

if TYPE_CHECKING:
    from governor.engine.model import LoadedModel


Check = Callable[["LoadedModel"], None]
OnSmall = Callable[[Check], None]


def with_small(ladder: str, check: Check) -> None:
    """In the child: `check` on the small demo model with a 256-token context."""
    from governor.engine.model import LoadedModel

    models = models_from_ladder(load_ladder(Path(ladder)))
    model = LoadedModel(
        models["small"], EngineConfig(model="small", n_ctx=256, kv_type="f16", threads=1, max_tokens_per_s=None)
    )
    try:
        check(model)
    finally:
        model.close()


@pytest.fixture
def small(demo_ladder: Path) -> OnSmall:
    """Runs a module-level check function on the small model in a child process."""
    return lambda check: in_child(with_small, str(demo_ladder), check)


def turns(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "sys prompt"}]
    for i in range(n):
        msgs += [
            {"role": "user", "content": f"question {i} " * 5},
            {"role": "assistant", "content": f"answer {i} " * 5},
        ]
    return [*msgs, {"role": "user", "content": "the last question"}]


def _prompt_is_rendered_with_the_models_chat_template(small: LoadedModel) -> None:
    text = small.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tokens = small.encode(text, prompt=True)
    assert small.llm.tokenize(b"<|im_start|>", add_bos=False, special=True)[0] == tokens[0]


def test_prompt_is_rendered_with_the_models_chat_template(small: OnSmall) -> None:
    small(_prompt_is_rendered_with_the_models_chat_template)


def _fit_keeps_everything_that_fits(small: LoadedModel) -> None:
    fitted = fit(small, turns(1), 256, answer_room=16)
    assert fitted.trimmed_messages == 0
    assert fitted.tokens == small.encode(small.render(turns(1)), prompt=True)


def test_fit_keeps_everything_that_fits(small: OnSmall) -> None:
    small(_fit_keeps_everything_that_fits)


def _fit_drops_oldest_whole_turns_keeping_system_and_last(small: LoadedModel) -> None:
    msgs = turns(10)
    fitted = fit(small, msgs, 256, answer_room=32)
    assert fitted.trimmed_messages > 0
    assert fitted.trimmed_messages % 2 == 0
    kept = [msgs[0], *msgs[1 + fitted.trimmed_messages :]]
    assert fitted.tokens == small.encode(small.render(kept), prompt=True)
    assert len(fitted.tokens) + 32 <= 256
    one_more = [msgs[0], *msgs[1 + fitted.trimmed_messages - 2 :]]
    assert len(small.encode(small.render(one_more), prompt=True)) + 32 > 256  # the most recent turns that fit


def test_fit_drops_oldest_whole_turns_keeping_system_and_last(small: OnSmall) -> None:
    small(_fit_drops_oldest_whole_turns_keeping_system_and_last)


def _fit_counts_the_answer_so_far(small: LoadedModel) -> None:
    without = fit(small, turns(4), 256, answer_room=16)
    with_answer = fit(small, turns(4), 256, answer_room=16, answer_so_far="partial answer " * 20)
    assert with_answer.trimmed_messages > without.trimmed_messages


def test_fit_counts_the_answer_so_far(small: OnSmall) -> None:
    small(_fit_counts_the_answer_so_far)


def _a_last_message_that_cannot_fit_is_refused(small: LoadedModel) -> None:
    with pytest.raises(PromptTooLong, match="context holds 256"):
        fit(small, [{"role": "user", "content": "word " * 300}], 256, answer_room=16)


def test_a_last_message_that_cannot_fit_is_refused(small: OnSmall) -> None:
    small(_a_last_message_that_cannot_fit_is_refused)


def test_text_stream_holds_back_a_possible_stop_sequence() -> None:
    ts = TextStream(["STOP"])
    assert ts.push(b"hello S") == "hello "
    assert ts.push(b"T") == ""
    assert ts.push(b"ar") == "STar"
    assert ts.push(b" then ST") == " then "
    assert ts.push(b"OP and more") == ""
    assert ts.stopped
    assert ts.text == "hello STar then "
    assert ts.flush() == ""


def test_text_stream_joins_split_utf8() -> None:
    ts = TextStream([])
    snowman = "☃".encode()
    assert ts.push(snowman[:1]) == ""
    assert ts.push(snowman[1:]) == "☃"
    assert ts.flush() == ""


def test_request_fields_are_strictly_typed() -> None:
    ok = ChatRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],'
        ' "temperature": 0, "stop": "x", "unknown_field": 1}'
    )
    assert ok.messages[0].text() == "a"
    assert ok.stops() == ["x"]
    with pytest.raises(ValidationError):
        ChatRequest.model_validate_json('{"model": "m", "messages": [{"role": "user", "content": "a"}], "top_k": "4"}')


def config_change_resolution(demo_ladder: Path) -> None:
    """In the child: a quantized KV type makes `resolve` read the model's head size with llama.cpp."""
    models = models_from_ladder(load_ladder(demo_ladder))
    now = EngineConfig(model="large", n_ctx=2048, kv_type="f16", threads=2, max_tokens_per_s=5.0)
    assert resolve(now, {"max_tokens_per_s": None}, models).max_tokens_per_s is None
    assert resolve(now, {"threads": 1}, models).max_tokens_per_s == 5.0
    swapped = resolve(now, {"model": "small", "kv_type": "q4_0"}, models)
    assert now.needs_reload(swapped)
    assert not now.needs_reload(resolve(now, {"threads": 1}, models))
    with pytest.raises(ConfigRefused) as refused:
        resolve(now, {"model": "tiny"}, models)
    assert refused.value.status == 404


def test_config_change_resolution(demo_ladder: Path) -> None:
    in_child(config_change_resolution, demo_ladder)
