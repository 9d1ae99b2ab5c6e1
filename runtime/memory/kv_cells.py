"""Per-stream KV cell bookkeeping (llama-kv-cells.h): which cell holds which position of which
sequences, without touching the K/V tensors.

A cell is empty when pos == -1. A non-empty cell belongs to one or more sequences (a shared
prompt prefix is stored once). `shift` accumulates position changes (seq_add / seq_div) not yet
applied to the cached keys; the K-shift re-rotates them and resets it. `ext` keeps the token
id a cell was made from. `used` is the ordered set of non-empty cells, kept as a count plus a
cached max so `used_max_p1` (what attention must scan) is O(1). Each sequence has a position
multiset with O(log n) min/max, so seq_pos_min/max never scan the cells.

Every mutator checks its precondition and raises KVCellsError: a violated one is a bug in the
caller, and silently continuing would corrupt the cache.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np


class KVCellsError(AssertionError):
    """A KVCells precondition was violated (a bug in the caller, never a user error)."""


class PosMultiset:
    """Multiset of ints with O(log n) amortised min/max: a count dict plus two lazy heaps."""

    __slots__ = ("cnt", "_lo", "_hi")

    def __init__(self):
        self.cnt: dict[int, int] = {}
        self._lo: list[int] = []  # min-heap of positions (may hold stale entries)
        self._hi: list[int] = []  # max-heap (negated)

    def clear(self) -> None:
        self.cnt.clear()
        self._lo.clear()
        self._hi.clear()

    def __len__(self) -> int:
        return len(self.cnt)  # distinct positions

    def add(self, p: int) -> None:
        c = self.cnt.get(p, 0)
        self.cnt[p] = c + 1
        if c == 0:
            heapq.heappush(self._lo, p)
            heapq.heappush(self._hi, -p)
            if len(self._lo) > 2 * len(self.cnt) + 64:
                self._lo = list(self.cnt)
                heapq.heapify(self._lo)
                self._hi = [-x for x in self.cnt]
                heapq.heapify(self._hi)

    def remove(self, p: int) -> None:
        c = self.cnt.get(p, 0)
        if c <= 0:
            raise KVCellsError(f"position {p} is not in the sequence's position set")
        if c == 1:
            del self.cnt[p]
        else:
            self.cnt[p] = c - 1

    def min(self) -> int:
        if not self.cnt:
            return -1
        lo, cnt = self._lo, self.cnt
        while lo[0] not in cnt:
            heapq.heappop(lo)
        return lo[0]

    def max(self) -> int:
        if not self.cnt:
            return -1
        hi, cnt = self._hi, self.cnt
        while -hi[0] not in cnt:
            heapq.heappop(hi)
        return -hi[0]


class CellsSnapshot(NamedTuple):
    """The state of a list of cells (for undo / save): parallel arrays, one entry per cell."""

    idxs: np.ndarray  # [n] i32
    pos: np.ndarray  # [n] i32
    shift: np.ndarray  # [n] i32
    ext: np.ndarray  # [n] i32
    seq: np.ndarray  # [n, n_seq_max] bool


class KVCells:
    """Cell metadata of one stream of a KV cache."""

    def __init__(self, size: int, n_seq_max: int):
        if size <= 0 or n_seq_max <= 0:
            raise KVCellsError(f"bad KVCells geometry size={size} n_seq_max={n_seq_max}")
        self.n_seq_max = n_seq_max
        self.resize(size)

    # ---- whole-stream -----------------------------------------------------------------------

    def resize(self, n: int) -> None:
        self.pos = np.full(n, -1, dtype=np.int32)  # [size] -1 = empty
        self.shift = np.zeros(n, dtype=np.int32)  # [size] pending position delta
        self.ext = np.full(n, -1, dtype=np.int32)  # [size] token id the cell came from
        self.seq = np.zeros((n, self.n_seq_max), dtype=bool)  # [size, n_seq_max]
        self.nseq = np.zeros(n, dtype=np.int32)  # [size] number of sequences in the cell
        self.seq_pos = [PosMultiset() for _ in range(self.n_seq_max)]
        self.reset()

    def reset(self) -> None:
        self.pos.fill(-1)
        self.shift.fill(0)
        self.ext.fill(-1)
        self.seq.fill(False)
        self.nseq.fill(0)
        self.has_shift = False
        self.n_used = 0
        self._max_p1 = 0
        for sp in self.seq_pos:
            sp.clear()

    def reset_shift(self) -> None:
        self.has_shift = False
        self.shift.fill(0)

    @property
    def size(self) -> int:
        return int(self.pos.shape[0])

    def get_used(self) -> int:
        return self.n_used

    def used_cells(self) -> np.ndarray:
        """The `used` set in ascending order (i32)."""
        return np.flatnonzero(self.pos >= 0).astype(np.int32)

    def used_min(self) -> int:
        u = np.flatnonzero(self.pos >= 0)
        return int(u[0]) if u.size else 0

    def used_max_p1(self) -> int:
        return self._max_p1

    def get_has_shift(self) -> bool:
        return self.has_shift

    # ---- used-set maintenance ---------------------------------------------------------------

    def _used_insert(self, i: int) -> None:
        self.n_used += 1
        if i + 1 > self._max_p1:
            self._max_p1 = i + 1

    def _used_erase(self, i: int) -> None:
        self.n_used -= 1
        if i + 1 == self._max_p1:
            nz = np.flatnonzero(self.pos[:i] >= 0)
            self._max_p1 = int(nz[-1]) + 1 if nz.size else 0

    def _seq_pos_rm(self, i: int) -> None:
        p = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]).tolist():
            self.seq_pos[s].remove(p)

    def _seq_pos_add(self, i: int) -> None:
        p = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]).tolist():
            self.seq_pos[s].add(p)

    def _check(self, i: int) -> None:
        if not 0 <= i < self.pos.shape[0]:
            raise KVCellsError(f"cell {i} out of range [0, {self.pos.shape[0]})")

    def _check_seq(self, s: int) -> None:
        if not 0 <= s < self.n_seq_max:
            raise KVCellsError(f"seq_id {s} out of range [0, {self.n_seq_max})")

    # ---- copies (prepare's dry run, undo, state save) ---------------------------------------

    def cp(self, idxs) -> CellsSnapshot:
        idxs = np.asarray(idxs, dtype=np.int32)
        if idxs.size and (idxs.min() < 0 or idxs.max() >= self.size):
            raise KVCellsError("cp: cell index out of range")
        return CellsSnapshot(
            idxs.copy(), self.pos[idxs].copy(), self.shift[idxs].copy(), self.ext[idxs].copy(), self.seq[idxs].copy()
        )

    def set(self, snap: CellsSnapshot) -> None:
        """Put back the cells of a snapshot (any order; later entries win on duplicates)."""
        for j, i in enumerate(snap.idxs.tolist()):
            self._check(i)
            old_p = int(self.pos[i])
            new_p = int(snap.pos[j])
            if old_p != -1:
                self._seq_pos_rm(i)
            self.pos[i] = new_p
            self.shift[i] = snap.shift[j]
            self.ext[i] = snap.ext[j]
            self.seq[i] = snap.seq[j]
            self.nseq[i] = int(np.count_nonzero(snap.seq[j]))
            if old_p == -1 and new_p != -1:
                self._used_insert(i)
            elif old_p != -1 and new_p == -1:
                self._used_erase(i)
            if new_p != -1:
                self._seq_pos_add(i)
        if np.any(snap.shift != 0):
            self.has_shift = True

    # ---- single-cell mutators (each checks its precondition) --------------------------------

    def is_empty(self, i: int) -> bool:
        return self.pos[i] == -1

    def _make_empty(self, i: int) -> None:
        """Reset cell i to the empty state and drop it from `used`. The caller has already
        removed i's positions from the per-sequence multisets (they key on the old pos)."""
        self.seq[i] = False
        self.nseq[i] = 0
        self.pos[i] = -1
        self.ext[i] = -1
        self.shift[i] = 0
        self._used_erase(i)

    def rm(self, i: int) -> None:
        """Clear a non-empty cell."""
        self._check(i)
        if self.pos[i] == -1:
            raise KVCellsError(f"rm: cell {i} is already empty")
        self._seq_pos_rm(i)
        self._make_empty(i)

    def seq_rm(self, i: int, s: int) -> bool:
        """Remove sequence s from cell i (which must hold it); True if the cell is now free."""
        self._check(i)
        self._check_seq(s)
        if self.pos[i] == -1 or not self.seq[i, s]:
            raise KVCellsError(f"seq_rm: cell {i} does not hold seq {s}")
        self.seq[i, s] = False
        self.seq_pos[s].remove(int(self.pos[i]))
        self.nseq[i] -= 1
        if self.nseq[i] == 0:
            self._make_empty(i)
            return True
        return False

    def seq_keep(self, i: int, s: int) -> bool:
        """Keep only sequence s in cell i; True if the cell became free (it lacked s)."""
        self._check(i)
        self._check_seq(s)
        if self.seq[i, s]:
            if self.nseq[i] > 1:
                self._seq_pos_rm(i)
                self.seq[i] = False
                self.seq[i, s] = True
                self.nseq[i] = 1
                self.seq_pos[s].add(int(self.pos[i]))
            return False
        if self.nseq[i] > 0:
            self._seq_pos_rm(i)
            self._make_empty(i)
            return True
        if self.pos[i] != -1:
            raise KVCellsError(f"seq_keep: cell {i} has a position but no sequence")
        return False

    def seq_count(self, i: int) -> int:
        self._check(i)
        if self.pos[i] == -1:
            raise KVCellsError(f"seq_count: cell {i} is empty")
        return int(self.nseq[i])

    def seq_has(self, i: int, s: int) -> bool:
        return bool(self.seq[i, s])

    def seq_get(self, i: int) -> int:
        """The one sequence of a cell that has exactly one."""
        if self.nseq[i] != 1:
            raise KVCellsError(f"seq_get: cell {i} holds {int(self.nseq[i])} sequences, not 1")
        return int(np.argmax(self.seq[i]))

    def seq_add(self, i: int, s: int) -> None:
        """Add sequence s to non-empty cell i (which must not hold it yet)."""
        self._check(i)
        self._check_seq(s)
        if self.pos[i] == -1:
            raise KVCellsError(f"seq_add: cell {i} is empty")
        if self.seq[i, s]:
            raise KVCellsError(f"seq_add: cell {i} already holds seq {s}")
        self.seq[i, s] = True
        self.nseq[i] += 1
        self.seq_pos[s].add(int(self.pos[i]))

    def seq_pos_min(self, s: int) -> int:
        self._check_seq(s)
        return self.seq_pos[s].min()

    def seq_pos_max(self, s: int) -> int:
        self._check_seq(s)
        return self.seq_pos[s].max()

    def pos_get(self, i: int) -> int:
        if self.pos[i] == -1:
            raise KVCellsError(f"pos_get: cell {i} is empty")
        return int(self.pos[i])

    def get_shift(self, i: int) -> int:
        if self.pos[i] == -1:
            raise KVCellsError(f"get_shift: cell {i} is empty")
        return int(self.shift[i])

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        p = self.pos[i]
        return bool(p >= 0 and p >= p0 and p < p1)

    def pos_set(self, i: int, p: int) -> None:
        """Give empty cell i position p (sequences are added with seq_add)."""
        self._check(i)
        if self.pos[i] != -1 or self.nseq[i] != 0:
            raise KVCellsError(f"pos_set: cell {i} is not empty")
        if p < 0:
            raise KVCellsError(f"pos_set: negative position {p}")
        self.pos[i] = p
        self._used_insert(i)

    def ext_set(self, i: int, tok: int) -> None:
        self._check(i)
        self.ext[i] = tok

    def pos_add(self, i: int, d: int) -> bool:
        """pos += d (and shift += d) for non-empty cell i; True if it fell below 0 (freed)."""
        self._check(i)
        if self.pos[i] == -1:
            raise KVCellsError(f"pos_add: cell {i} is empty")
        self._seq_pos_rm(i)
        self.pos[i] += d
        self.shift[i] += d
        self.has_shift = True
        if self.pos[i] < 0:
            self._make_empty(i)
            return True
        self._seq_pos_add(i)
        return False

    def pos_div(self, i: int, d: int) -> None:
        """pos //= d for non-empty cell i, recording the change in shift."""
        self._check(i)
        if self.pos[i] == -1:
            raise KVCellsError(f"pos_div: cell {i} is empty")
        if d <= 0:
            raise KVCellsError(f"pos_div: divisor must be positive, got {d}")
        p_old = int(self.pos[i])
        self._seq_pos_rm(i)
        self.pos[i] = p_old // d
        self.shift[i] += p_old - int(self.pos[i])
        self._seq_pos_add(i)
        self.has_shift = True

    # ---- vectorised selections --------------------------------------------------------------

    def cells_of_seq(self, s: int, p0: int, p1: int) -> np.ndarray:
        """Cells holding seq s with position in [p0, p1), ascending (i64)."""
        p = self.pos
        return np.flatnonzero(self.seq[:, s] & (p >= p0) & (p < p1))

    def cells_in_range(self, p0: int, p1: int) -> np.ndarray:
        """Non-empty cells with position in [p0, p1), ascending (i64)."""
        p = self.pos
        return np.flatnonzero((p >= p0) & (p < p1))

    # ---- invariants (tests, debug) ----------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise KVCellsError unless the derived structures agree with pos/seq."""
        used = self.pos >= 0
        if int(used.sum()) != self.n_used:
            raise KVCellsError(f"n_used {self.n_used} != non-empty cells {int(used.sum())}")
        nz = np.flatnonzero(used)
        if (int(nz[-1]) + 1 if nz.size else 0) != self._max_p1:
            raise KVCellsError("used_max_p1 is stale")
        if not np.array_equal(self.nseq, self.seq.sum(axis=1)):
            raise KVCellsError("nseq disagrees with seq")
        if np.any(self.seq[~used]):
            raise KVCellsError("an empty cell holds a sequence")
        if np.any(self.shift[~used] != 0):
            raise KVCellsError("an empty cell has a pending shift")
        for s in range(self.n_seq_max):
            ps = self.pos[self.seq[:, s]]
            want: dict[int, int] = {}
            for p in ps.tolist():
                want[p] = want.get(p, 0) + 1
            if want != self.seq_pos[s].cnt:
                raise KVCellsError(f"position multiset of seq {s} disagrees with the cells")
            if self.seq_pos[s].min() != (int(ps.min()) if ps.size else -1):
                raise KVCellsError(f"seq_pos_min({s}) is wrong")
            if self.seq_pos[s].max() != (int(ps.max()) if ps.size else -1):
                raise KVCellsError(f"seq_pos_max({s}) is wrong")
