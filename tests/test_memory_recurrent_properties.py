"""Property test (hypothesis): random sequences of recurrent-memory operations keep its
invariants - each sequence's tail cell holds it and no other cell does, empty cells have no
position and no foreign source, `used` counts the non-empty cells - prepare() is a pure dry run, a
failed decode restores every cell and state row, and a refused seq_rm changes nothing."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.runtime.batch import Batch
from tests.helpers.recurrent_stubs import assert_same, make_rctx, recr_of, snapshot

N_SEQ = 3

op = st.one_of(
    st.tuples(st.just("decode"), st.integers(0, N_SEQ - 1), st.integers(1, 9)),
    st.tuples(st.just("decode2"), st.integers(0, N_SEQ - 1), st.integers(1, 5)),
    st.tuples(st.just("fail"), st.integers(0, N_SEQ - 1), st.integers(2, 9)),
    st.tuples(st.just("rm"), st.integers(-1, N_SEQ - 1), st.integers(0, 12)),
    st.tuples(st.just("cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("keep"), st.integers(0, N_SEQ - 1), st.just(0)),
    st.tuples(st.just("shift"), st.integers(0, N_SEQ - 1), st.integers(1, 3)),
    st.tuples(st.just("prepare"), st.integers(0, N_SEQ - 1), st.integers(1, 9)),
    st.tuples(st.just("shared"), st.integers(0, N_SEQ - 1), st.integers(1, 5)),
)


def check_invariants(mem):
    r = recr_of(mem)
    c = r.cells
    for s in range(N_SEQ):
        holders = np.flatnonzero(c.seq[:, s])
        assert holders.size <= 1, f"seq {s} held by cells {holders}"
        if holders.size:
            assert c.tail[s] == holders[0], f"tail of {s} is {c.tail[s]}, held by {holders[0]}"
            assert c.pos[holders[0]] >= 0
        else:
            assert c.tail[s] == -1
    empty = ~c.seq.any(axis=1)
    assert (c.pos[empty] == -1).all()
    # an empty cell inside a ubatch's range keeps src = itself, its row zeroed (as llama.cpp)
    assert ((c.src[empty] == -1) | (c.src[empty] == np.flatnonzero(empty))).all()
    assert r.get_used() == int((~empty).sum())
    for s in range(N_SEQ):
        assert mem.seq_pos_max(s) == (int(c.pos[c.tail[s]]) if c.tail[s] >= 0 else -1)


def batch_for(mem, seqs, n, tok0):
    toks, pos, sids = [], [], []
    for s in seqs:
        p0 = mem.seq_pos_max(s) + 1
        toks += [(tok0 + 3 * i + 11 * s) % 64 for i in range(n)]
        pos += list(range(p0, p0 + n))
        sids += [[s]] * n
    return Batch(toks, pos=pos, seq_ids=sids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.lists(op, min_size=1, max_size=25))
def test_random_recurrent_memory_operations_keep_the_invariants(hybrid, ops):
    ctx = make_rctx(hybrid=hybrid, n_seq_max=N_SEQ, n_ubatch=4)
    mem = ctx.memory
    for i, (kind, a, b) in enumerate(ops):
        if kind in ("decode", "decode2"):
            seqs = [a] if kind == "decode" else sorted({a, (a + 1) % N_SEQ})
            assert ctx.decode(batch_for(mem, seqs, b, i)) == 0
        elif kind == "shared":  # tokens of two sequences at once (a shared prompt)
            pair = sorted({a, (a + 1) % N_SEQ})
            p0 = mem.seq_pos_max(pair[0]) + 1
            if p0 == mem.seq_pos_max(pair[1]) + 1:
                toks = [(i + 5 * t) % 64 for t in range(b)]
                assert ctx.decode(Batch(toks, pos=list(range(p0, p0 + b)), seq_ids=[pair] * b)) == 0
        elif kind == "fail":
            before = snapshot(mem)
            ctx.model.fail_at = ctx.model.n_calls + 2
            assert ctx.decode(batch_for(mem, [a], b + 4, i)) == -3  # fails in its 2nd ubatch
            ctx.model.fail_at = None
            assert_same(before, snapshot(mem))
        elif kind == "rm":
            before = snapshot(mem)
            if not mem.seq_rm(a, b, -1):
                assert_same(before, snapshot(mem))
        elif kind == "cp" and a != b:  # as every caller does: empty the target first (a hybrid's
            mem.seq_rm(b, -1, -1)  # KV part keeps dst's cells on seq_cp, its recurrent part not)
            mem.seq_cp(a, b, -1, -1)
        elif kind == "keep":
            mem.seq_keep(a)
        elif kind == "shift":
            if not hybrid:  # positions of a KV cache shift through a K-shift update
                mem.seq_add(a, -1, -1, b)
        elif kind == "prepare":
            before = snapshot(mem)
            if ctx.balloc.init(batch_for(mem, [a], b, i), 64, N_SEQ, mem):
                mem.init_batch(ctx.balloc, 4)
            assert_same(before, snapshot(mem))
        check_invariants(mem)
