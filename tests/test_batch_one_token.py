"""A generated token's one-token batch takes BatchAllocator's and split_simple's short paths
(runtime/batch.py: _init_one, UBatch.one_token); they must leave exactly the state, the answer
and the error message the general pass gives, for valid and invalid batches alike."""

import numpy as np
import pytest

from kvchat.runtime.batch import Batch, BatchAllocator, UBatch
from tests.test_batch import FakeMemory

MEM = FakeMemory({0: (0, 9), 1: (3, 5)})

CASES = [  # (batch, memory, output_all)
    (Batch([7]), MEM, False),
    (Batch([7]), None, False),
    (Batch([7], pos=[10]), MEM, False),
    (Batch([7], pos=[11]), MEM, False),  # gap after position 9: refused
    (Batch([7], pos=[0]), None, False),
    (Batch([7], pos=[-1]), MEM, False),
    (Batch([7], pos=[2**31 - 1]), None, False),
    (Batch([7], seq_ids=[1]), MEM, False),
    (Batch([7], seq_ids=[[2]], pos=[0]), MEM, False),
    (Batch([7], seq_ids=[3], pos=[4]), MEM, False),
    (Batch([7], seq_ids=[4]), MEM, False),  # seq id out of range
    (Batch([7], seq_ids=[-1]), MEM, False),
    (Batch([100]), MEM, False),  # token out of range
    (Batch([-3]), MEM, False),
    (Batch([7], logits=[False]), MEM, False),
    (Batch([7], logits=[False]), MEM, True),
    (Batch([7], logits=[True]), None, False),
    (Batch.one_seq([7], 10, 0), MEM, False),
    (Batch.one_seq([7], 6, 1, all_logits=True), MEM, False),
    (Batch.one_seq([7], 5, 1), MEM, False),  # position 5 is already stored for seq 1
]


def _state(ba):
    return {k: (v.tolist(), str(v.dtype)) if isinstance(v, np.ndarray) else v for k, v in vars(ba).items()}


def _ubatch_state(ub):
    out = {}
    for k in UBatch.__slots__:
        v = getattr(ub, k)
        out[k] = (v.tolist(), str(v.dtype)) if isinstance(v, np.ndarray) else v
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_one_token_batches_leave_the_general_passes_state(case, monkeypatch):
    batch, memory, output_all = CASES[case]
    fast = BatchAllocator()
    ok_fast = fast.init(batch, 100, 4, memory, output_all)
    slow = BatchAllocator()
    monkeypatch.setattr(BatchAllocator, "_init_one", BatchAllocator._init_batch)
    ok_slow = slow.init(batch, 100, 4, memory, output_all)
    assert (ok_fast, fast.error) == (ok_slow, slow.error)
    assert _state(fast) == _state(slow)
    if not ok_fast:
        return
    ub_fast = fast.split_simple(8)
    slow.split_reset()
    ub_slow = slow._ubatch_add(np.arange(0, 1, dtype=np.int32), 1, equal_seqs=False)  # the general split
    assert _ubatch_state(ub_fast) == _ubatch_state(ub_slow)
    assert _state(fast) == _state(slow)
    assert fast.split_simple(8) is None and fast.get_n_used() == 1


def test_one_seq_batch_is_the_checked_constructors():
    """Batch.one_seq builds its fields directly; Batch() from the same values gives the same."""
    for toks, pos0, seq, all_logits in (([5], 3, 0, False), ([5, 6, 7], 0, 2, True), ([], 4, 1, False)):
        a = Batch.one_seq(toks, pos0, seq, all_logits=all_logits)
        n = len(toks)
        b = Batch(
            toks, pos=np.arange(pos0, pos0 + n), seq_ids=[[seq]] * n, logits=np.ones(n, bool) if all_logits else None
        )
        for k in Batch.__slots__:
            x, y = getattr(a, k), getattr(b, k)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), k
            else:
                assert x == y, k
        assert a.seq_ids is None or all(s is not t for s, t in zip(a.seq_ids, a.seq_ids[1:]))  # not one shared list
