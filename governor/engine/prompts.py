"""An answer's prompt in the model's context: built for a request, and built again after a reload changed the model
or made the context too small (a re-rendered, trimmed conversation with the answer so far re-tokenized as text)."""

from __future__ import annotations

import jinja2

from governor.engine.chat import CompletionRequest, PromptTooLong, TextStream, fit, room_for_answer
from governor.engine.events import Failed
from governor.engine.jobs import Job, Run
from governor.engine.model import LoadedModel
from governor.engine.tools import conversation
from governor.engine.window import fit_chunked


def prepare(m: LoadedModel, job: Job, *, chunked: bool = True) -> Run | Failed:
    """The answer's prompt in the current context, or the 400 that says why there is none. With `chunked`, a chat
    that outgrew the context loses old turns in large chunks, the same cut kept while it fits
    (governor.engine.window); without, as few turns as possible go (each turn then changes the prompt's start)."""
    req = job.request
    if job.constraint.grammar is not None:
        why = m.grammar_error(job.constraint.grammar)
        if why is not None:
            return Failed(400, f"the requested output format: {why}", "invalid_grammar")
    if isinstance(req, CompletionRequest):
        tokens = m.encode_plain(req.text())
        if len(tokens) >= m.n_ctx:
            return Failed(400, str(PromptTooLong(len(tokens), m.n_ctx)), "context_length_exceeded")
        return Run(job, None, req.text(), tokens, len(tokens), TextStream(req.stops()))
    messages = conversation(req, job.constraint.tools)
    try:
        room = room_for_answer(m.n_ctx, req.token_limit())
        if chunked:
            fitted, m.cut = fit_chunked(m, messages, m.n_ctx, answer_room=room, last=m.cut)
        else:
            fitted = fit(m, messages, m.n_ctx, answer_room=room)
    except PromptTooLong as exc:
        return Failed(400, str(exc), "context_length_exceeded")
    except (ValueError, jinja2.TemplateError) as exc:  # the template's raise_exception(), e.g. role order
        return Failed(400, f"the model's chat template refused the messages: {exc}", "invalid_messages")
    stops = req.stops() + ([m.template_stop] if m.template_stop else [])
    run = Run(job, messages, None, list(fitted.tokens), len(fitted.tokens), TextStream(stops))
    run.trimmed = fitted.trimmed_messages
    return run


def refit(m: LoadedModel, run: Run, room: int) -> bool:
    """Put `run`'s prompt and answer so far into `m`'s context with `room` left; False when even the last message
    and the answer do not fit. Sets ctx_tokens, answer_from and trimmed."""
    so_far = run.answer.decode(errors="ignore")
    if run.messages is None:  # a plain completion: no turns to trim
        assert run.prompt is not None
        prompt = m.encode_plain(run.prompt)
        answer = m.encode(so_far, prompt=False) if so_far else []
        if len(prompt) + len(answer) >= m.n_ctx:
            return False
        run.ctx_tokens, run.answer_from = prompt + answer, len(prompt)
    else:
        try:
            fitted = fit(m, run.messages, m.n_ctx, answer_room=room, answer_so_far=so_far)
        except PromptTooLong:
            return False
        run.ctx_tokens = list(fitted.tokens)
        run.answer_from = len(fitted.tokens) - fitted.answer_tokens
        run.trimmed = max(run.trimmed, fitted.trimmed_messages)
    run.text.reset_decoder()
    return True
