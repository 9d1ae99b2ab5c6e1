"""Batch validation, completion, and the three split strategies."""

import numpy as np
import pytest

from kvchat.runtime.batch import Batch, BatchAllocator


class FakeMemory:
    """Only what BatchAllocator asks of memory: per-sequence min/max positions."""

    def __init__(self, ranges):
        self.ranges = ranges  # seq -> (min, max)

    def seq_pos_min(self, s):
        return self.ranges.get(s, (-1, -1))[0]

    def seq_pos_max(self, s):
        return self.ranges.get(s, (-1, -1))[1]


def init(batch, n_vocab=100, n_seq_max=4, memory=None, output_all=False):
    ba = BatchAllocator()
    ok = ba.init(batch, n_vocab, n_seq_max, memory, output_all)
    return ba, ok


def test_fills_positions_sequence_and_output():
    ba, ok = init(Batch([1, 2, 3]), memory=FakeMemory({0: (0, 9)}))
    assert ok, ba.error
    assert ba.pos.tolist() == [10, 11, 12]
    assert ba.seq_id == [[0], [0], [0]]
    assert ba.output.tolist() == [False, False, True]
    assert ba.get_n_outputs() == 1 and ba.get_n_tokens() == 3


def test_auto_positions_per_sequence_and_shared_tokens():
    mem = FakeMemory({0: (0, 4), 1: (0, 4)})
    b = Batch([7, 8, 9, 10], seq_ids=[[0, 1], [0], [1], [0]])
    ba, ok = init(b, memory=mem)
    assert ok, ba.error
    # token 0 is in both sequences at 5; then seq 0 continues at 6, seq 1 at 6
    assert ba.pos.tolist() == [5, 6, 6, 7]
    assert ba.has_cpl


def test_output_all_overrides():
    ba, ok = init(Batch([1, 2, 3], logits=[True, False, False]), output_all=True)
    assert ok and ba.output.all()


@pytest.mark.parametrize(
    "batch, mem, needle",
    [
        (Batch([1, 100]), None, "invalid token[1] = 100"),
        (Batch([-1]), None, "invalid token[0] = -1"),
        (Batch([1], seq_ids=[[4]]), None, "invalid seq_id[0] = 4"),
        (Batch([1], seq_ids=[[]]), None, "no sequence id"),
        (Batch([1], seq_ids=[[1, 1]]), None, "twice"),
        (Batch([1, 2], pos=[5, 6]), FakeMemory({0: (0, 3)}), "Y = X + 1"),
        (Batch([1, 2], pos=[0, 2]), None, "not continuous"),
        (Batch([1, 2, 3], pos=[1, 0, 2]), None, "decreasing"),
        (Batch([1, 2], pos=[0, 0], seq_ids=[[0, 1], [1]]), FakeMemory({0: (0, 3), 1: (0, 5)}), "Y = X + 1"),
        (Batch([1], pos=[6], seq_ids=[[0, 1]]), FakeMemory({0: (2, 5), 1: (0, 5)}), "diverged"),
        (Batch([1, 2, 3], pos=[0, 1, 3], seq_ids=[[0, 1], [0, 2], [0]]), None, "not continuous"),
        (Batch([1, 2, 3], pos=[2, 1, 3], seq_ids=[[0, 1], [0, 1], [0]]), None, "decreasing"),
        (Batch([1], pos=[-2]), None, "positions"),
    ],
)
def test_invalid_batches_rejected_with_reason(batch, mem, needle):
    ba, ok = init(batch, memory=mem)
    assert not ok
    assert needle in ba.error


def test_empty_batch_rejected():
    ba, ok = init(Batch(np.zeros(0, np.int32)))
    assert not ok and "n_tokens == 0" in ba.error


def test_batch_field_lengths_checked():
    with pytest.raises(ValueError):
        Batch([1, 2], pos=[0])


def test_one_seq_helper():
    b = Batch.one_seq([4, 5, 6], pos0=10, seq_id=2, all_logits=True)
    assert b.pos.tolist() == [10, 11, 12] and b.seq_ids == [[2]] * 3 and b.logits.all()


def test_split_simple():
    ba, ok = init(Batch(list(range(10)), logits=[i % 3 == 0 for i in range(10)]))
    assert ok
    sizes = []
    while (ub := ba.split_simple(4)) is not None:
        sizes.append(ub.n_tokens)
        assert ub.token.dtype == np.int32 and ub.pos.dtype == np.int32
    assert sizes == [4, 4, 2]
    assert ba.get_n_used() == 10
    assert ba.out_ids == [0, 3, 6, 9]


def interleaved3(n_each=4):
    """Three sequences, tokens interleaved 0,1,2,0,1,2,..."""
    toks, seqs, pos = [], [], []
    for k in range(n_each):
        for s in range(3):
            toks.append(10 * s + k)
            seqs.append([s])
            pos.append(k)
    return Batch(toks, pos=pos, seq_ids=seqs)


def test_split_equal_gives_each_sequence_the_same_count():
    ba, ok = init(interleaved3(4))
    assert ok
    ubs = []
    while (ub := ba.split_equal(6, sequential=True)) is not None:
        ubs.append(ub)
    assert [u.n_tokens for u in ubs] == [6, 6]
    for u in ubs:
        assert u.n_seqs == 3 and u.n_seq_tokens == 2 and u.equal_seqs
        # grouped by sequence, ascending seq ids, positions in order inside each group
        assert u.seq0.tolist() == [0, 0, 1, 1, 2, 2]
    assert ubs[0].pos.tolist() == [0, 1, 0, 1, 0, 1]
    assert ubs[1].pos.tolist() == [2, 3, 2, 3, 2, 3]
    assert ba.get_n_used() == 12


def test_split_equal_unequal_lengths_leave_remainder_for_next_ubatches():
    b = Batch([1, 2, 3, 4, 5], pos=[0, 1, 2, 0, 1], seq_ids=[[0], [0], [0], [1], [1]])
    ba, ok = init(b)
    assert ok
    ubs = []
    while (ub := ba.split_equal(8, sequential=False)) is not None:
        ubs.append((ub.seq_id_unq, ub.n_seq_tokens))
    assert ubs == [([0, 1], 2), ([0], 1)]


def test_split_equal_sequential_refuses_coupled_sequences():
    b = Batch([1, 2], pos=[0, 1], seq_ids=[[0, 1], [0, 1]])
    ba, ok = init(b)
    assert ok
    assert ba.split_equal(4, sequential=True) is None
    assert ba.get_n_used() < ba.get_n_tokens()  # the caller sees the split failed


def test_split_seq_one_sequence_set_per_ubatch():
    b = Batch([1, 2, 3, 4], pos=[0, 0, 1, 1], seq_ids=[[0], [1], [0], [1]])
    ba, ok = init(b)
    assert ok
    got = []
    while (ub := ba.split_seq(8)) is not None:
        got.append((ub.seq_id_unq, ub.pos.tolist()))
    assert got == [([0], [0, 1]), ([1], [0, 1])]
