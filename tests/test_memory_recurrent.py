"""The recurrent and hybrid memories through Context.decode with a stub recurrent model (real
conv / scan kernels): batch splits, dry-run prepare, exact rollback, state round trips,
seq_cp independence, refused partial seq_rm, checkpoints."""

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.memory.interface import AttentionMemoryContext, RecurrentMemoryContext
from tests.helpers.recurrent_stubs import assert_same, make_rctx, recr_of, snapshot

TOKENS = (np.arange(30) * 7 + 3) % 64


def _logits_by_split(hybrid, n_ubatch, calls):
    ctx = make_rctx(hybrid=hybrid, n_ubatch=n_ubatch)
    out, p = [], 0
    for n in calls:
        assert ctx.decode(Batch.one_seq(TOKENS[p : p + n], p, all_logits=True)) == 0
        out.append(ctx.get_logits().copy())
        p += n
    return np.concatenate(out)


@pytest.mark.parametrize("hybrid", [False, True])
def test_one_batch_7_token_ubatches_and_token_by_token_give_identical_logits(hybrid):
    one = _logits_by_split(hybrid, 512, [30])
    np.testing.assert_array_equal(_logits_by_split(hybrid, 7, [30]), one)
    np.testing.assert_array_equal(_logits_by_split(hybrid, 512, [1] * 30), one)
    np.testing.assert_array_equal(_logits_by_split(hybrid, 512, [7, 7, 7, 9]), one)


@pytest.mark.parametrize("hybrid", [False, True])
def test_the_forward_sees_the_contexts_the_protocols_state(hybrid):
    ctx = make_rctx(hybrid=hybrid)
    seen = []
    orig = ctx.model.forward

    def fwd(ub, mctx, min_macs=None):
        recr = mctx.get_recr() if hybrid else mctx
        seen.append(isinstance(recr, RecurrentMemoryContext))
        if hybrid:
            seen.append(isinstance(mctx.get_attn(), AttentionMemoryContext))
        return orig(ub, mctx)

    ctx.model.forward = fwd
    assert ctx.decode(Batch.one_seq(TOKENS[:5], 0)) == 0
    assert seen and all(seen)


@pytest.mark.parametrize("hybrid", [False, True])
def test_prepare_leaves_every_state_untouched(hybrid):
    ctx = make_rctx(hybrid=hybrid, n_seq_max=2, n_ubatch=4)
    assert ctx.decode(Batch(TOKENS[:8], pos=[0, 1, 2, 3, 0, 1, 2, 3], seq_ids=[0, 0, 0, 0, 1, 1, 1, 1])) == 0
    before = snapshot(ctx.memory)
    assert ctx.balloc.init(Batch(TOKENS[8:14], pos=[4, 5, 6, 4, 5, 6], seq_ids=[0, 0, 0, 1, 1, 1]), 64, 2, ctx.memory)
    mctx = ctx.memory.init_batch(ctx.balloc, 4)
    assert mctx.get_status().name == "SUCCESS"
    assert_same(before, snapshot(ctx.memory))


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_decode_failing_in_its_third_ubatch_restores_every_state_cell_bit_for_bit(hybrid):
    ctx = make_rctx(hybrid=hybrid, n_ubatch=4)
    assert ctx.decode(Batch.one_seq(TOKENS[:5], 0)) == 0
    ctx.model.fail_at = ctx.model.n_calls + 3
    before = snapshot(ctx.memory)
    assert ctx.decode(Batch.one_seq(TOKENS[5:17], 5)) == -3  # ubatches of 4: fails in the 3rd
    assert_same(before, snapshot(ctx.memory))
    ctx.model.fail_at = None
    assert ctx.decode(Batch.one_seq(TOKENS[5:17], 5)) == 0  # and the memory still works


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("whole", [True, False])
def test_state_save_clear_load_reproduces_the_next_logits_exactly(hybrid, whole):
    ctx = make_rctx(hybrid=hybrid)
    assert ctx.decode(Batch.one_seq(TOKENS[:20], 0)) == 0
    blob = ctx.state_get_data() if whole else ctx.state_seq_get_data(0)
    assert ctx.decode(Batch.one_seq(TOKENS[20:21], 20)) == 0
    want = ctx.get_logits().copy()
    ctx.memory.clear(True)
    n = ctx.state_set_data(blob) if whole else ctx.state_seq_set_data(blob, 0)
    assert n == len(blob)
    assert ctx.memory.seq_pos_max(0) == 19
    assert ctx.decode(Batch.one_seq(TOKENS[20:21], 20)) == 0
    np.testing.assert_array_equal(ctx.get_logits(), want)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_corrupt_state_is_refused_with_nothing_changed(hybrid):
    ctx = make_rctx(hybrid=hybrid)
    assert ctx.decode(Batch.one_seq(TOKENS[:10], 0)) == 0
    blob = ctx.state_get_data()
    before = snapshot(ctx.memory)
    assert ctx.state_set_data(blob[:-3]) == 0
    assert ctx.state_set_data(blob + b"x") == 0
    assert_same(before, snapshot(ctx.memory))


@pytest.mark.parametrize("hybrid,unified", [(False, True), (True, True), (True, False)])
def test_seq_cp_then_diverging_keeps_independent_states(hybrid, unified):
    ctx = make_rctx(hybrid=hybrid, n_seq_max=2, unified=unified)
    assert ctx.decode(Batch.one_seq(TOKENS[:10], 0)) == 0
    ctx.memory.seq_cp(0, 1, -1, -1)
    a, b = TOKENS[10:13], (TOKENS[10:13] + 5) % 64
    assert (
        ctx.decode(
            Batch(
                np.concatenate([a, b]), pos=[10, 11, 12] * 2, seq_ids=[0] * 3 + [1] * 3, logits=[False, False, True] * 2
            )
        )
        == 0
    )
    got = ctx.get_logits().copy()
    for i, cont in enumerate((a, b)):
        ref = make_rctx(hybrid=hybrid)
        assert ref.decode(Batch.one_seq(np.concatenate([TOKENS[:10], cont]), 0)) == 0
        np.testing.assert_array_equal(got[i], ref.get_logits()[0])
    r = recr_of(ctx.memory)
    assert r.cells.tail[0] != r.cells.tail[1]


def test_a_partial_seq_rm_is_refused_and_changes_nothing_removing_past_the_end_succeeds():
    for hybrid in (False, True):
        ctx = make_rctx(hybrid=hybrid)
        assert ctx.decode(Batch.one_seq(TOKENS[:10], 0)) == 0
        before = snapshot(ctx.memory)
        assert ctx.memory.seq_rm(0, 5, -1) is False
        assert_same(before, snapshot(ctx.memory))
        assert ctx.memory.seq_rm(0, 10, -1) is True  # past the last position: nothing to do
        assert_same(before, snapshot(ctx.memory))
        assert ctx.memory.seq_rm(0, -1, -1) is True
        assert ctx.memory.seq_pos_max(0) == -1


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_checkpoint_restores_the_state_taken_before_the_answer(hybrid):
    ctx = make_rctx(hybrid=hybrid)
    assert ctx.decode(Batch.one_seq(TOKENS[:12], 0)) == 0
    ck = ctx.memory.seq_checkpoint(0)
    assert ck.pos == 11 and ck.n_bytes > 0
    assert ctx.decode(Batch.one_seq(TOKENS[12:20], 12)) == 0
    assert ctx.memory.seq_restore(0, ck)
    assert ctx.memory.seq_pos_max(0) == 11
    assert ctx.decode(Batch.one_seq(TOKENS[12:13], 12)) == 0
    ref = make_rctx(hybrid=hybrid)
    assert ref.decode(Batch.one_seq(TOKENS[:13], 0)) == 0
    np.testing.assert_array_equal(ctx.get_logits(), ref.get_logits())


def test_a_full_pool_refuses_a_new_sequence_and_leaves_memory_untouched():
    ctx = make_rctx(n_seq_max=1)
    assert ctx.decode(Batch.one_seq(TOKENS[:4], 0)) == 0
    before = snapshot(ctx.memory)
    assert ctx.decode(Batch.one_seq(TOKENS[:2], 0, seq_id=1)) == -1  # seq 1 >= n_seq_max
    assert_same(before, snapshot(ctx.memory))


def test_breakdown_and_log_line_give_the_state_bytes():
    ctx = make_rctx(n_seq_max=3)
    r = ctx.memory
    b = r.memory_breakdown()
    assert b["r_bytes"] == 2 * 3 * 3 * 8 * 4 and b["s_bytes"] == 2 * 3 * 4 * 8 * 4
    assert "llama_memory_recurrent" in r.log_line() and r.memory_type() == "llama_memory_recurrent"
    h = make_rctx(hybrid=True).memory
    assert h.memory_type() == "llama_memory_hybrid"
    assert h.memory_breakdown()["total_bytes"] == (
        h.mem_attn.memory_breakdown()["total_bytes"] + h.mem_recr.memory_breakdown()["total_bytes"]
    )


def test_a_prompt_shared_by_several_sequences_gives_each_the_same_state():
    """Tokens belonging to sequences 0..2 at once (a prompt decoded once for -np 3): the
    sequences share one state cell, then diverge as if each had decoded the prompt alone."""
    ctx = make_rctx(n_seq_max=3, n_ubatch=4)
    assert ctx.decode(Batch(TOKENS[:6], pos=np.arange(6), seq_ids=[[0, 1, 2]] * 6)) == 0
    r = recr_of(ctx.memory)
    assert r.cells.tail[0] == r.cells.tail[1] == r.cells.tail[2] and r.get_used() == 1
    nxt = [(TOKENS[6] + 3 * s) % 64 for s in range(3)]
    assert ctx.decode(Batch(nxt, pos=[6] * 3, seq_ids=[0, 1, 2], logits=[True] * 3)) == 0
    got = ctx.get_logits().copy()
    assert r.get_used() == 3
    for s in range(3):
        ref = make_rctx()
        assert ref.decode(Batch.one_seq(np.concatenate([TOKENS[:6], [nxt[s]]]), 0)) == 0
        np.testing.assert_array_equal(got[s], ref.get_logits()[0])
