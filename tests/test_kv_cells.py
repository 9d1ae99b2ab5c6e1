"""KVCells: cell bookkeeping, cell by cell, and every mutator's precondition."""

import numpy as np
import pytest

from kvchat.runtime.memory.kv_cells import KVCells, KVCellsError, PosMultiset


def filled(size=8, n_seq=3):
    """cells 0..3: seq 0 at pos 0..3; cell 5: seq 1 and 2 at pos 7."""
    c = KVCells(size, n_seq)
    for i in range(4):
        c.pos_set(i, i)
        c.seq_add(i, 0)
    c.pos_set(5, 7)
    c.seq_add(5, 1)
    c.seq_add(5, 2)
    c.check_invariants()
    return c


def test_empty_cells():
    c = KVCells(8, 2)
    assert c.get_used() == 0 and c.used_max_p1() == 0 and c.used_min() == 0
    assert c.seq_pos_min(0) == -1 and c.seq_pos_max(1) == -1
    assert all(c.is_empty(i) for i in range(8))
    c.check_invariants()


def test_fill_and_query():
    c = filled()
    assert c.pos.tolist() == [0, 1, 2, 3, -1, 7, -1, -1]
    assert c.used_cells().tolist() == [0, 1, 2, 3, 5]
    assert c.get_used() == 5 and c.used_max_p1() == 6 and c.used_min() == 0
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 3)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (7, 7)
    assert c.seq_count(5) == 2 and c.seq_count(0) == 1
    assert c.seq_get(2) == 0
    assert c.seq_has(5, 2) and not c.seq_has(5, 0)
    assert c.pos_in(3, 3, 4) and not c.pos_in(3, 0, 3) and not c.pos_in(4, -5, 100)


def test_seq_rm_frees_only_when_last_sequence_leaves():
    c = filled()
    assert c.seq_rm(5, 1) is False  # seq 2 still holds cell 5
    assert c.pos[5] == 7 and c.seq_pos_max(1) == -1 and c.seq_pos_max(2) == 7
    assert c.seq_rm(5, 2) is True
    assert c.pos[5] == -1 and c.used_max_p1() == 4 and c.get_used() == 4
    c.check_invariants()


def test_rm_and_used_max_tracking():
    c = filled()
    c.rm(5)
    assert c.used_max_p1() == 4
    c.rm(3)
    assert c.used_max_p1() == 3 and c.seq_pos_max(0) == 2
    c.rm(0)
    assert c.used_min() == 1 and c.seq_pos_min(0) == 1
    c.check_invariants()


def test_seq_keep():
    c = filled()
    assert c.seq_keep(5, 2) is False  # keeps the cell, drops seq 1
    assert c.seq_count(5) == 1 and c.seq_get(5) == 2
    assert c.seq_keep(0, 2) is True  # lacked seq 2: freed
    assert c.pos[0] == -1
    assert c.seq_keep(6, 2) is False  # empty stays empty
    c.check_invariants()


def test_pos_add_accumulates_shift_and_frees_below_zero():
    c = filled()
    assert c.pos_add(3, 10) is False
    assert c.pos[3] == 13 and c.shift[3] == 10 and c.get_has_shift()
    assert c.seq_pos_max(0) == 13
    assert c.pos_add(0, -1) is True  # 0 - 1 < 0: freed
    assert c.pos[0] == -1 and c.shift[0] == 0 and c.get_used() == 4
    c.check_invariants()
    c.reset_shift()
    assert not c.get_has_shift() and not c.shift.any()


def test_pos_div():
    c = filled()
    c.pos_div(3, 2)  # 3 -> 1, shift -2... recorded as old - new
    assert c.pos[3] == 1 and c.shift[3] == 2
    assert c.seq_pos_max(0) == 2
    c.check_invariants()


def test_cp_set_round_trip():
    c = filled()
    snap = c.cp([0, 4, 5])
    c.rm(0)
    c.rm(5)
    c.pos_set(4, 9)
    c.seq_add(4, 1)
    c.set(snap)
    c.check_invariants()
    ref = filled()
    np.testing.assert_array_equal(c.pos, ref.pos)
    np.testing.assert_array_equal(c.seq, ref.seq)
    assert c.used_max_p1() == ref.used_max_p1() and c.get_used() == ref.get_used()


@pytest.mark.parametrize(
    "op",
    [
        lambda c: c.rm(4),  # empty
        lambda c: c.seq_add(4, 0),  # empty cell
        lambda c: c.seq_add(0, 0),  # already holds it
        lambda c: c.seq_rm(0, 1),  # does not hold it
        lambda c: c.seq_rm(4, 0),  # empty
        lambda c: c.pos_set(0, 5),  # not empty
        lambda c: c.pos_set(4, -3),  # negative position
        lambda c: c.seq_get(5),  # two sequences
        lambda c: c.seq_count(4),  # empty
        lambda c: c.pos_add(4, 1),  # empty
        lambda c: c.pos_div(4, 2),  # empty
        lambda c: c.pos_div(0, 0),  # bad divisor
        lambda c: c.pos_get(6),
        lambda c: c.seq_add(0, 3),  # seq out of range
        lambda c: c.rm(8),  # cell out of range
    ],
)
def test_preconditions_are_enforced(op):
    c = filled()
    before = (c.pos.copy(), c.seq.copy())
    with pytest.raises(KVCellsError):
        op(c)
    np.testing.assert_array_equal(c.pos, before[0])
    np.testing.assert_array_equal(c.seq, before[1])


def test_pos_multiset_duplicates_and_lazy_heaps():
    m = PosMultiset()
    assert m.min() == -1 and m.max() == -1
    for p in [5, 3, 5, 9]:
        m.add(p)
    assert (m.min(), m.max(), len(m)) == (3, 9, 3)
    m.remove(9)
    m.remove(5)
    assert m.max() == 5  # one 5 left
    m.remove(5)
    assert m.max() == 3 and m.min() == 3
    with pytest.raises(KVCellsError):
        m.remove(5)
    for p in range(1000):  # many adds/removes: heaps compact, answers stay right
        m.add(p)
        m.remove(p)
    assert (m.min(), m.max()) == (3, 3)
    assert len(m._lo) < 200


def test_vectorised_selections():
    c = filled()
    assert c.cells_of_seq(0, 1, 3).tolist() == [1, 2]
    assert c.cells_in_range(2, 100).tolist() == [2, 3, 5]
