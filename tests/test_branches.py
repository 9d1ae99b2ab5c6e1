"""Chat branches and alternatives on sequences of one cache (runtime/chat/branches.py), tiny qwen3:
a fork shares every cell (nothing decoded), each branch continues as a solo conversation would,
dropping a branch frees exactly its own cells, a context shift never moves shared cells, and
/alts + /pick keep one answer's cells."""

import numpy as np
import pytest

from kvchat.runtime.chat.branches import BranchConversation, Branches
from kvchat.runtime.chat.conversation import ContextFull, ConversationConfig, FullCause
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.model import Model
from kvchat.runtime.sampling import Sampler, SamplingParams
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.load(
        write_tiny_model(
            tmp_path_factory.mktemp("br") / "q.gguf",
            arch="qwen3",
            n_layer=2,
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            n_ff=96,
        )
    )


def conv_on(model, n_ctx=1024, n_seq_max=4, temp=0.0, n_predict=6, events=None, **cfg):
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq_max))
    return BranchConversation(
        ctx,
        model.vocab,
        None,
        Sampler(SamplingParams(temp=temp, seed=3)),
        ConversationConfig(raw=True, n_predict=n_predict, **cfg),
        notify=(events.append if events is not None else None),
    )


def used(ctx):
    return ctx.memory.cells[0].get_used()


def test_a_fork_shares_every_cell_and_each_branch_continues_like_a_solo_chat(model):
    c = conv_on(model)
    c.ask("first message")
    n = used(c.ctx)
    br = Branches(c)
    b = br.fork("alt")
    assert used(c.ctx) == n and b.seq_id == 1 and b.tokens == c.tokens
    cells = c.ctx.memory.cells[0]
    assert cells.seq[:n, 0].all() and cells.seq[:n, 1].all()
    assert br.tree()[1][4] == n  # all of main's cells are alt's too
    b.ask("second on alt")
    br.switch("main")
    c.ask("second on main")
    for conv, follow in ((c, "second on main"), (b, "second on alt")):
        solo = conv_on(model)
        solo.ask("first message")
        solo.ask(follow)
        assert conv.messages == solo.messages
    # each turn re-tokenizes the raw text and keeps the common prefix: what is shared shrinks to it
    assert [t[0] for t in br.tree()] == ["main", "alt"] and 0 < br.tree()[1][4] <= n


def test_dropping_a_branch_frees_exactly_its_own_cells(model):
    c = conv_on(model)
    c.ask("hello there")
    br = Branches(c)
    b = br.fork("b")
    before_pos = c.ctx.memory.cells[0].pos.copy()
    b.ask("more words on b")
    cells = c.ctx.memory.cells[0]
    own = int(np.count_nonzero(cells.seq[:, 1] & ~cells.seq[:, 0]))
    assert own >= b.n_cached - c.n_cached
    with pytest.raises(KvchatError, match="current branch"):
        br.drop("b")
    br.switch("main")
    assert br.drop("b") == own
    np.testing.assert_array_equal(cells.pos, np.where(cells.seq[:, 0], before_pos, -1))
    assert cells.get_used() == c.n_cached
    assert not cells.seq[:, 1].any() and cells.seq[: c.n_cached, 0].all()


def test_a_context_shift_that_would_move_shared_cells_is_refused(model):
    events = []
    c = conv_on(model, n_ctx=256, n_predict=10, events=events, ignore_eos=True, keep=0)
    c.config.n_predict = 0
    c.ask("word " * 30 + ".")
    br = Branches(c)
    b = br.fork("b")
    b.config.n_predict = -1  # until the context is full
    snapshot = c.ctx.memory.cells[0].pos.copy()
    stats = b.ask("\ngo on")
    cells = c.ctx.memory.cells[0]
    assert not np.any(cells.seq[:, 0] & ~cells.seq[:, 1])  # main holds no cell of its own
    assert b.n_cached == 256 and cells.get_used() == 256  # full: the shift was refused
    assert stats.stop == "ctx_full"
    assert any(isinstance(e, ContextFull) and e.cause == FullCause.SHARED for e in events)
    shared = c.ctx.memory.cells[0].seq[:, 0]
    np.testing.assert_array_equal(c.ctx.memory.cells[0].pos[shared], snapshot[shared])
    # alone again, the branch may shift as usual
    assert not b._can_shift()
    br.switch("b")
    br.drop("main")
    assert b._can_shift() and b._make_room(b.n_cached, 1) is not None and b.n_dropped > 0


def test_alternatives_then_pick_keeps_one_answers_cells(model):
    c = conv_on(model, temp=0.9, n_predict=5)
    c.ask("tell me")
    prompt_len = len(c.render(c.messages[:-1]))
    br = Branches(c)
    alts = br.alternatives(3, seed=100)
    assert [r.seq_id for r in alts] == [0, 1, 2] and len({r.text for r in alts}) == 3
    with pytest.raises(KvchatError, match="/pick"):
        br.fork("x")
    chosen = br.pick(2)
    assert c.messages[-1]["content"] == chosen.text
    cells = c.ctx.memory.cells[0]
    assert not cells.seq[:, 1:].any()
    assert used(c.ctx) == c.n_cached == prompt_len + 4  # the 5th token was sampled, not decoded
    assert c.tokens[prompt_len:] == chosen.ids[:-1]
    c.ask("next")  # the conversation goes on from the picked answer
    assert c.messages[-3]["content"] == chosen.text
