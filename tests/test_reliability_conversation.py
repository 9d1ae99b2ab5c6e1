"""A conversation on a tiny real model pushed past its context and then edited: /undo, /system and
/regen after context shifts re-fit instead of failing every later turn; -n 0, empty prompts,
--keep past the context and bytes that are not UTF-8 each do the one sensible thing."""

import numpy as np
import pytest

from kvchat.runtime.chat.conversation import ContextFull, ContextShifted, Conversation, ConversationConfig, FullCause
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.sampling import Sampler, SamplingParams

LONG = "hello world and the chat " * 12  # ~70 tokens per message


@pytest.fixture(scope="module")
def engine(tiny_model):
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.model import Model
    from kvchat.runtime.text.chat_template import ChatTemplate

    model = Model.load(tiny_model())
    ctx = Context(model, ContextParams(n_ctx=256))
    return model, ctx, ChatTemplate.from_gguf(model.gguf, model.vocab)


def make(engine, **cfg):
    model, ctx, template = engine
    ctx.memory.clear(True)
    events = []
    conv = Conversation(
        ctx,
        model.vocab,
        template,
        Sampler(SamplingParams(temp=0.0, seed=1)),
        ConversationConfig(**{"n_predict": 40, "ignore_eos": True, **cfg}),
        notify=events.append,
    )
    return conv, events


def assert_cache_mirrors_tokens(conv):
    """The cache holds exactly cached_tokens() at positions 0..n_cached-1 (cell by cell)."""
    mem = conv.ctx.memory
    assert mem.seq_pos_min(0) == (0 if conv.n_cached else -1)
    assert mem.seq_pos_max(0) == conv.n_cached - 1
    cells = mem.cells[0]
    used = np.flatnonzero(cells.pos >= 0)
    assert sorted(cells.pos[used].tolist()) == list(range(conv.n_cached))
    assert conv.n_cached <= conv.n_ctx


def fill_past_the_context(conv, turns=5):
    for i in range(turns):
        conv.ask(f"{i} " + LONG)
    assert conv.n_dropped > 0, "the test must have shifted the context"


def same_next_logits_as_fresh_decode(conv, engine):
    """The cached state gives the logits a fresh decode of cached_tokens() gives (tolerance)."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_tokens

    model, _, _ = engine
    fresh = Context(model, ContextParams(n_ctx=256))
    ref = decode_tokens(fresh, conv.cached_tokens(), 0, 0)
    return np.abs(np.asarray(ref) - np.asarray(conv.logits)).max()


def test_undo_after_a_context_shift_keeps_the_chat_going(engine):
    conv, events = make(engine)
    fill_past_the_context(conv)
    conv.undo()
    assert_cache_mirrors_tokens(conv)
    for i in range(3):  # every later turn works, not just the next one
        stats = conv.ask(f"next {i} " + LONG)
        assert stats.n_gen == 40
        assert_cache_mirrors_tokens(conv)


def test_system_change_after_a_context_shift_refits_the_conversation(engine):
    conv, events = make(engine)
    fill_past_the_context(conv)
    conv.set_system("You are terse. " * 5)
    stats = conv.ask("and now? " + LONG)
    assert stats.n_gen == 40
    assert conv.messages[0] == {"role": "system", "content": "You are terse. " * 5}
    assert any(isinstance(e, ContextShifted) for e in events)
    assert_cache_mirrors_tokens(conv)
    # the kept start is the new system prompt, the last message is whole in the cache
    assert (
        conv.cached_tokens()[: conv.n_keep_shift]
        == conv.render(conv.messages[:1] + [{"role": "user", "content": "A"}])[: conv.n_keep_shift]
    )
    conv.ask("once more " + LONG)
    assert_cache_mirrors_tokens(conv)


def test_refit_cache_gives_the_logits_of_decoding_what_it_holds(engine):
    conv, _ = make(engine, n_predict=0)
    fill_past_the_context(conv, turns=6)
    conv.set_system("Be brief. " * 8)
    conv.ask("question " + LONG)  # re-fitted; -n 0 leaves the logits of the prompt's last token
    assert_cache_mirrors_tokens(conv)
    assert same_next_logits_as_fresh_decode(conv, engine) < 1e-3


def test_regen_after_undo_past_a_shift(engine):
    conv, _ = make(engine)
    fill_past_the_context(conv)
    conv.undo()
    conv.ask("hi " + LONG)
    stats = conv.regenerate()
    assert stats.n_gen == 40
    assert_cache_mirrors_tokens(conv)


def test_n_predict_zero_generates_nothing(engine):
    conv, _ = make(engine, n_predict=0)
    stats = conv.ask("hello")
    assert stats.n_gen == 0 and stats.n_gen_decoded == 0 and stats.stop == "limit"
    assert conv.messages[-1] == {"role": "assistant", "content": ""}
    assert conv.n_cached == len(conv.render(conv.messages[:-1]))  # the prompt only


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_prompt_is_refused_and_nothing_changes(engine, text):
    conv, _ = make(engine)
    with pytest.raises(KvchatError, match="the prompt is empty"):
        conv.ask(text)
    assert conv.messages == [] and conv.n_cached == 0


def test_keep_past_the_context_says_why_the_answer_stopped(engine):
    conv, events = make(engine, keep=100000, n_predict=400)
    stats = conv.ask("tell me " + LONG)
    assert stats.stop == "ctx_full"
    full = [e for e in events if isinstance(e, ContextFull)]
    assert full and full[-1].cause == FullCause.KEEP_ALL
    from kvchat.cli.wording import event_text

    assert "--keep covers all of it" in event_text(full[-1])
    assert_cache_mirrors_tokens(conv)


def test_message_with_invalid_utf8_is_stored_replaced(engine):
    conv, _ = make(engine, n_predict=2)
    conv.ask(b"caf\xe9 ok".decode("utf-8", "surrogateescape"))
    assert conv.messages[0]["content"] == "caf\ufffd ok"
    conv.set_system("\udcff sys")
    assert conv.system_prompt == "\ufffd sys"
