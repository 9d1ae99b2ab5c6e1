"""Property tests (hypothesis): random operation sequences on a plain and an iSWA cache.

After every operation: each sequence's positions form one contiguous range (shifts are drawn only
for a sequence that owns its cells alone: a cell has one position for all its sequences, so
llama.cpp's seq_add on shared cells moves them for every sharer, and a shift past 0 removes the
cell for all of them - test_shifting_shared_cells_moves_them_for_every_sequence pins that down), `used` equals the
non-empty cells, seq_pos_min/max agree with the cells (KVCells.check_invariants). Around every
decode attempt: `prepare()` is a pure dry run, and a decode that fails (no slot, compute
error) leaves every cell, head and position set exactly as it was.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.runtime.batch import Batch, BatchAllocator
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from tests.helpers.memory_stubs import StubModel, assert_same_cells, cells_snapshot, make_hparams

N_SEQ = 3

op = st.one_of(
    st.tuples(st.just("decode"), st.integers(0, N_SEQ - 1), st.integers(1, 40)),
    st.tuples(st.just("decode2"), st.integers(0, N_SEQ - 1), st.integers(1, 12)),
    st.tuples(st.just("fail"), st.integers(0, N_SEQ - 1), st.integers(2, 30)),
    st.tuples(st.just("rm_tail"), st.integers(0, N_SEQ - 1), st.integers(0, 60)),
    st.tuples(st.just("rm_head"), st.integers(0, N_SEQ - 1), st.integers(0, 60)),
    st.tuples(st.just("cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("keep"), st.integers(0, N_SEQ - 1), st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, N_SEQ - 1), st.integers(-20, 20)),
    st.tuples(st.just("prepare"), st.integers(0, N_SEQ - 1), st.integers(1, 64)),
)


def caches(mem):
    return [mem.kv_base, mem.kv_swa] if hasattr(mem, "kv_swa") else [mem]


def snap(mem):
    return [cells_snapshot(kv) for kv in caches(mem)]


def same(a, b):
    for x, y in zip(a, b):
        assert_same_cells(x, y)


def check_invariants(mem):
    for kv in caches(mem):
        for c in kv.cells:
            c.check_invariants()
            for s in range(N_SEQ):
                ps = np.unique(c.pos[c.seq[:, s]])
                if ps.size:
                    assert ps[-1] - ps[0] + 1 == ps.size, f"seq {s} positions not contiguous: {ps}"
                    assert (c.seq_pos_min(s), c.seq_pos_max(s)) == (ps[0], ps[-1])


def shares_cells(mem, s):
    """True when a cell of sequence s also belongs to another sequence."""
    for kv in caches(mem):
        for c in kv.cells:
            if (c.seq[:, s] & (c.seq.sum(axis=1) > 1)).any():
                return True
    return False


def next_batch(mem, seq, n, tok0=0):
    p0 = mem.seq_pos_max(seq) + 1
    return Batch((np.arange(n) + tok0) % 64, pos=np.arange(p0, p0 + n), seq_ids=[[seq]] * n)


def run(ctx, model, ops):
    mem = ctx.memory
    for kind, a, b in ops:
        if kind == "decode":
            before = snap(mem)
            code = ctx.decode(next_batch(mem, a, b))
            assert code in (0, 1)
            if code == 1:
                same(before, snap(mem))
        elif kind == "decode2":  # two sequences interleaved in one batch
            s2 = (a + 1) % N_SEQ
            p = [mem.seq_pos_max(a) + 1, mem.seq_pos_max(s2) + 1]
            toks, pos, sids = [], [], []
            for k in range(b):
                for j, s in enumerate((a, s2)):
                    toks.append((k * 5 + s) % 64)
                    pos.append(p[j] + k)
                    sids.append([s])
            before = snap(mem)
            code = ctx.decode(Batch(toks, pos=pos, seq_ids=sids))
            assert code in (0, 1)
            if code == 1:
                same(before, snap(mem))
        elif kind == "fail":
            before = snap(mem)
            model.fail_at = model.n_calls + 2  # fail in the 2nd ubatch (if there is one)
            code = ctx.decode(next_batch(mem, a, b))
            model.fail_at = None
            assert code in (-3, 0, 1)
            if code != 0:
                same(before, snap(mem))
        elif kind == "rm_tail":
            mem.seq_rm(a, mem.seq_pos_min(a) + b if mem.seq_pos_min(a) >= 0 else b, -1)
        elif kind == "rm_head":
            mem.seq_rm(a, -1, mem.seq_pos_min(a) + b)
        elif kind == "cp" and a != b:
            mem.seq_rm(b, -1, -1)
            mem.seq_cp(a, b, -1, -1)
        elif kind == "keep":
            mem.seq_keep(a)
        elif kind == "shift" and mem.get_can_shift() and not shares_cells(mem, a):
            mem.seq_add(a, 0, -1, b)
            ctx.memory_update()
        elif kind == "prepare":
            before = snap(mem)
            ba = BatchAllocator()
            if ba.init(next_batch(mem, a, b), 64, N_SEQ, mem):
                mem.init_batch(ba, ctx.cparams.n_ubatch)
            same(before, snap(mem))
        check_invariants(mem)


SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@SETTINGS
@given(ops=st.lists(op, min_size=1, max_size=14), n_ubatch=st.sampled_from([4, 7, 16]))
def test_random_operations_keep_invariants_plain_cache(ops, n_ubatch):
    model = StubModel(make_hparams(n_layer=1))
    ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=N_SEQ, n_ubatch=n_ubatch))
    run(ctx, model, ops)


@SETTINGS
@given(ops=st.lists(op, min_size=1, max_size=14), n_swa=st.sampled_from([4, 16]), swa_full=st.booleans())
def test_random_operations_keep_invariants_iswa_cache(ops, n_swa, swa_full):
    hp = make_hparams(n_layer=2, n_swa=n_swa, swa_layers=[True, False])
    model = StubModel(hp)
    ctx = Context(model, ContextParams(n_ctx=512, n_seq_max=N_SEQ, n_ubatch=8, swa_full=swa_full))
    run(ctx, model, ops)


def test_shifting_shared_cells_moves_them_for_every_sequence():
    """llama_kv_cells::pos_add: the shift of seq 1 moves the cells it shares with seq 0, and the cell
    pushed below position 0 is emptied for both - seq 0 is left with positions [0, 2]."""
    model = StubModel(make_hparams(n_layer=1))
    ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=N_SEQ, n_ubatch=16))
    mem = ctx.memory
    assert ctx.decode(next_batch(mem, 1, 2)) == 0
    mem.seq_cp(1, 0, -1, -1)
    assert ctx.decode(next_batch(mem, 0, 1)) == 0
    mem.seq_add(1, 0, -1, -1)
    ctx.memory_update()
    c = mem.cells[0]
    assert sorted(c.pos[c.seq[:, 0]].tolist()) == [0, 2]
    assert c.pos[c.seq[:, 1]].tolist() == [0]
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, 2)
