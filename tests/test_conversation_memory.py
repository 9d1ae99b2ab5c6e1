"""The conversation engine checks what the memory lets it do: a refused partial `seq_rm`
(a recurrent state) or a sliding window that no longer holds the cells a rewound prefix needs
both mean "decode the prompt whole" — never an answer from a cache that does not match."""

import numpy as np
import pytest

from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
from kvchat.runtime.sampling import Sampler, SamplingParams
from tests.test_conversation import FakeMemory, consistent, make, tok


class RecurrentLikeMemory(FakeMemory):
    """Refuses to cut a sequence in the middle, as llama.cpp's recurrent memory does."""

    def __init__(self):
        super().__init__()
        self.refused = 0

    def seq_rm(self, seq, p0, p1):
        last = self.seq_pos_max(seq)
        if (0 < p0 <= last) or (0 < p1 <= last):
            self.refused += 1
            return False
        return super().seq_rm(seq, p0, p1)

    def get_can_shift(self):
        return False


def recurrent_conv(**cfg):
    conv, ctx, notes = make(**cfg)
    ctx.memory = RecurrentLikeMemory()
    return conv, ctx, notes


def test_undo_on_a_memory_without_partial_removal_decodes_the_prompt_whole():
    conv, ctx, _ = recurrent_conv(n_predict=4)
    conv.ask("one")
    conv.ask("two")  # a follow-up only appends: no removal needed
    assert ctx.memory.refused == 0
    conv.undo()  # needs a cut in the middle: refused, so the sequence is emptied
    assert ctx.memory.refused == 1 and ctx.memory.cells == {} and conv.tokens == []
    s = conv.ask("three")
    assert s.n_prompt == len(conv.render(conv.messages[:-1]))  # everything, from position 0
    consistent(conv, ctx)


def test_regen_on_a_memory_without_partial_removal_still_answers_from_the_prompt():
    conv, ctx, _ = recurrent_conv(n_predict=5)
    first = conv.ask("hi")
    s = conv.regenerate()
    prompt = tok("[s]SYS|[u]hi|[a]")
    assert ctx.memory.refused >= 1 and s.n_prompt == len(prompt)
    assert s.n_gen == first.n_gen and conv.messages[-1]["role"] == "assistant"
    consistent(conv, ctx)
    assert conv.tokens[: len(prompt)] == prompt


def test_repair_empties_a_sequence_it_cannot_cut():
    conv, ctx, _ = recurrent_conv(n_predict=3)
    conv.ask("hi")
    n = conv.n_cached
    ctx.memory.cells[n] = 7
    ctx.memory.cells[n + 1] = 7
    conv.repair()  # cutting at n is a partial removal: the sequence is emptied instead
    assert ctx.memory.cells == {} and conv.tokens == [] and conv.n_cached == 0


@pytest.fixture(scope="module")
def gemma3(tiny_model):
    from kvchat.runtime.model import Model

    return Model.load(tiny_model("gemma3", n_swa=8, n_ctx_train=2048))


def real_conv(model, n_predict=100):
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.text.chat_template import ChatTemplate

    ctx = Context(
        model, ContextParams(n_ctx=1024, n_batch=64, n_ubatch=64, type_k="f32", type_v="f32", flash_attn="off")
    )
    return Conversation(
        ctx,
        model.vocab,
        ChatTemplate.from_gguf(model.gguf, model.vocab),
        Sampler(SamplingParams(temp=0.0, seed=1)),
        ConversationConfig(n_predict=n_predict, ignore_eos=True),
    )


TURNS = ["hello world", "the chat and the world", "hello hello", "the world and the chat"]


def test_rewinding_past_the_sliding_window_redecodes_instead_of_using_a_stale_cache(gemma3):
    """An 8-token window, so the SWA cache has 256 cells and reuses them after ~256 tokens.
    Undoing three exchanges of four rewinds to a prefix whose window cells were overwritten: the
    next turn decodes from 0, and answers bit-identically to a chat that never had them."""
    assert any(gemma3.hparams.swa_layers) and gemma3.hparams.n_swa == 8
    a = real_conv(gemma3)
    for t in TURNS:
        a.ask(t)
    assert a.n_cached > 400 and a.ctx.memory.seq_pos_min(0) > 100  # the window moved on
    a.undo()
    a.undo()
    a.undo()
    assert a.n_cached == 0  # refused to keep a prefix whose window was overwritten
    sa = a.ask("the end")

    b = real_conv(gemma3)
    b.ask(TURNS[0])
    sb = b.ask("the end")
    assert a.messages == b.messages and a.tokens == b.tokens
    assert sa.n_prompt == len(a.tokens) - sa.n_gen_decoded and sb.n_prompt < sa.n_prompt
    assert np.array_equal(a.logits, b.logits)


def test_rewinding_inside_the_window_keeps_the_cache(gemma3):
    """Undoing the last exchange leaves a prefix whose window is still held: only the new turn
    is decoded, and the answer equals a fresh chat's."""
    a = real_conv(gemma3)
    for t in TURNS:
        a.ask(t)
    a.undo()
    kept = a.n_cached
    assert kept > 300
    sa = a.ask("the end")
    assert sa.n_prompt < 40  # the new turn (and a re-tokenized tail), not the conversation

    b = real_conv(gemma3)
    for t in TURNS[:3]:
        b.ask(t)
    b.ask("the end")
    assert a.messages == b.messages and a.tokens == b.tokens
    assert np.array_equal(a.logits, b.logits)


@pytest.mark.parametrize("behind, served", [(0, False), (3, False), (5, False), (6, True), (20, True)])
def test_a_prefix_is_served_from_the_cache_only_while_its_window_is_held(gemma3, behind, served):
    """Keep a prefix whose last token is `behind` positions after the oldest SWA cell still
    held. The next token attends to the 7 positions before it: with fewer than 7 held the prompt
    is decoded whole (then the logits equal a fresh decode bit for bit); with 7 or more the
    prefix is kept (the cells sit in other slots, so the sums fold in another order: 1e-5)."""
    a = real_conv(gemma3)
    for t in TURNS:
        a.ask(t)
    pos_min = a.ctx.memory.seq_pos_min(0)
    assert pos_min > 100
    kept = pos_min + behind + 1
    desired = a.tokens[:kept] + a.vocab.tokenize("the end", add_special=False)
    n = a.prefill(desired)
    assert n == (len(desired) - kept if served else len(desired)) and a.n_cached == len(desired)
    fresh = real_conv(gemma3)
    assert fresh.prefill(desired) == len(desired)
    if served:
        np.testing.assert_allclose(a.logits, fresh.logits, rtol=0, atol=1e-5)
    else:
        assert np.array_equal(a.logits, fresh.logits)
