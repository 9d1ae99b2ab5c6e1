"""The recurrent memory's context (llama_memory_recurrent_context): a batch's ubatches, and per
ubatch the state rows the forward pass of a recurrent layer reads and writes
(RecurrentMemoryContext in runtime/memory/interface.py).

`apply()` runs find_slot for the current ubatch and journals the metadata and the state rows
of [head, head + n) the forward pass may write, so `rollback()` restores them bit for bit.
`get_r/get_s` stage the states as llama.cpp's build_rs does: zero the rs_z row, gather each
sequence's state from its src0 row, materialise the other cells of the range; `cpy_r/cpy_s`
store the new states into the sequences' cells.
"""

from __future__ import annotations

import numpy as np

from kvchat.runtime.memory.interface import MemoryContext, MemoryOpError, MemoryStatus


class RecurrentContext(MemoryContext):
    """A batch's ubatches; per ubatch the states the forward pass reads and writes."""

    def __init__(self, mem, status: MemoryStatus, ubatches=None, full=False):
        self.mem = mem
        self.status = status
        self.ubatches = ubatches or []
        self.i_cur = 0
        self.full = full
        self.journal: list = []  # (metadata snapshot, head, {rows}) per applied ubatch

    def next(self) -> bool:
        self.i_cur += 1
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise MemoryOpError("apply() on a failed memory context")
        if not self.ubatches:
            return True
        mem = self.mem
        snap = mem._snapshot()
        if not mem.find_slot(self.ubatches[self.i_cur]):
            mem._restore(snap)
            raise MemoryOpError("recurrent memory: a prepared ubatch no longer fits")
        lo, hi = mem.head, mem.head + mem.n  # the rows the forward pass may write
        rows = [(il, mem.r_l[il][lo:hi].copy(), mem.s_l[il][lo:hi].copy()) for il in mem.layers]
        self.journal.append((snap, lo, rows))
        return True

    def rollback(self) -> None:
        """Restore the metadata and every state row this context's ubatches touched."""
        mem = self.mem
        for snap, lo, rows in reversed(self.journal):
            for il, r, s in rows:
                mem.r_l[il][lo : lo + r.shape[0]] = r
                mem.s_l[il][lo : lo + s.shape[0]] = s
            mem._restore(snap)
        self.journal.clear()

    def get_ubatch(self):
        return self.ubatches[self.i_cur]

    def get_status(self) -> MemoryStatus:
        return self.status

    # ---- RecurrentMemoryContext ---------------------------------------------------------------

    def get_n_rs(self) -> int:
        return self.ubatches[self.i_cur].n_seqs

    def get_head(self) -> int:
        return 0 if self.full else self.mem.head

    def _gather(self, buf: np.ndarray) -> np.ndarray:
        """States the ubatch's sequences start from (build_rs): zero the rs_z row, read the
        main rows from their src0, then materialise the other cells of [head, head + n)."""
        mem = self.mem
        lo, n, n_rs = mem.head, mem.n, self.get_n_rs()
        src0 = mem.cells.src0[lo : lo + n]
        if mem.rs_z >= 0:
            buf[mem.rs_z] = 0.0
        main = buf[src0[:n_rs]]  # a copy: fancy indexing
        if n > n_rs:
            buf[lo + n_rs : lo + n] = buf[src0[n_rs:]]
        return main

    def get_r(self, il: int) -> np.ndarray:
        return self._gather(self.mem.r_l[il])

    def get_s(self, il: int) -> np.ndarray:
        return self._gather(self.mem.s_l[il])

    def cpy_r(self, il: int, r: np.ndarray) -> None:
        lo = self.mem.head
        self.mem.r_l[il][lo : lo + r.shape[0]] = r.reshape(r.shape[0], -1)

    def cpy_s(self, il: int, s: np.ndarray) -> None:
        lo = self.mem.head
        self.mem.s_l[il][lo : lo + s.shape[0]] = s.reshape(s.shape[0], -1)
