"""Recurrent memory state i/o (llama_memory_recurrent::state_write / state_read), llama.cpp's layout:

  u32 cell_count
  per cell:   i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id     (n_seq_id is 0 in a sequence blob)
  u32 s_trans (0), u32 n_layer (every layer of the model)
  per recurrent layer: i32 type_r (F32), u64 r_row_bytes, the cells' conv-state rows
  per recurrent layer: i32 type_s (F32), u64 s_row_bytes, the cells' SSM-state rows

Rows are those of each cell's data (`src`, which is the cell itself once a ubatch touched it).
Reading is two-phase: `state_parse` checks everything into arrays without changing memory;
`state_apply` places the cells (whole: clear, cells 0..n-1; one sequence: remove it, then
find_slot like a ubatch of its positions - undone if it does not fit) and copies the rows.
"""

from __future__ import annotations

import numpy as np

from kvchat.runtime.memory.state import StateError, StateReader, StateWriter

GGML_TYPE_F32 = 0


class RecurrentState:
    __slots__ = ("pos", "seqs", "r", "s")

    def __init__(self, pos, seqs, r, s):
        self.pos, self.seqs, self.r, self.s = pos, seqs, r, s


class RecurrentStateIO:
    """Mixed into MemoryRecurrent (uses its cells, layers, r_l / s_l, find_slot, seq_rm)."""

    def _cells_to_save(self, seq_id: int) -> np.ndarray:
        c = self.cells
        sel = c.seq.any(axis=1) if seq_id < 0 else c.seq[:, seq_id]
        return np.flatnonzero(sel)

    def state_write(self, io: StateWriter, seq_id: int = -1) -> None:
        if seq_id >= 0:
            self.check_seq(seq_id)
        c = self.cells
        idxs = self._cells_to_save(seq_id)
        io.write_u32(int(idxs.size))
        for i in idxs.tolist():
            io.write_i32(int(c.pos[i]))
            seqs = np.flatnonzero(c.seq[i]).tolist() if seq_id < 0 else []
            io.write_u32(len(seqs))
            for s in seqs:
                io.write_i32(int(s))
        rows = np.array([int(c.src[i]) if c.src[i] >= 0 else i for i in idxs.tolist()], dtype=np.int64)
        io.write_u32(0)  # s_trans
        io.write_u32(self.hparams.n_layer)
        for il in self.layers:
            io.write_i32(GGML_TYPE_F32)
            io.write_u64(4 * self.n_embd_r)
            io.write_array(self.r_l[il][rows])
        for il in self.layers:
            io.write_i32(GGML_TYPE_F32)
            io.write_u64(4 * self.n_embd_s)
            io.write_array(self.s_l[il][rows])

    def state_parse(self, io: StateReader, seq_id: int = -1) -> RecurrentState:
        name = "recurrent memory"
        n = io.read_u32()
        if n > self.size:
            raise StateError(f"{name}: not enough cells ({n} saved > {self.size})")
        pos = np.empty(n, dtype=np.int32)
        seqs: list[list[int]] = []
        seen: set[int] = set()
        for i in range(n):
            p = io.read_i32()
            n_seq = io.read_u32()
            if seq_id >= 0 and n_seq != 0:
                raise StateError(f"{name}: invalid seq_id-agnostic cell ({n_seq} sequences)")
            if n_seq > self.n_seq_max:
                raise StateError(f"{name}: cell {i} lists {n_seq} sequences (max {self.n_seq_max})")
            ss = [io.read_i32() for _ in range(n_seq)]
            for x in ss:
                if not 0 <= x < self.n_seq_max:
                    raise StateError(f"{name}: invalid seq_id, {x} is out of range [0, {self.n_seq_max})")
                if x in seen:
                    raise StateError(f"{name}: duplicate tail for seq_id {x}")
                seen.add(x)
            pos[i] = p
            seqs.append(ss)
        if seq_id >= 0 and n > 1:
            raise StateError(f"{name}: a sequence state holds {n} cells (one expected)")
        if io.read_u32() != 0:
            raise StateError(f"{name}: incompatible s transposition")
        n_layer = io.read_u32()
        if n_layer != self.hparams.n_layer:
            raise StateError(f"{name}: mismatched layer count ({n_layer} instead of {self.hparams.n_layer})")
        r = [self._parse_rows(io, name, "r", il, n, self.n_embd_r) for il in self.layers]
        s = [self._parse_rows(io, name, "s", il, n, self.n_embd_s) for il in self.layers]
        return RecurrentState(pos, seqs, r, s)

    @staticmethod
    def _parse_rows(io, name, which, il, n, width):
        t = io.read_i32()
        if t != GGML_TYPE_F32:
            raise StateError(f"{name}: mismatched {which} type (layer {il}: type {t}, f32 here)")
        rb = io.read_u64()
        if rb != 4 * width:
            raise StateError(f"{name}: mismatched {which} row size (layer {il}: {rb} != {4 * width})")
        return io.read_array(rb * n, (n, rb)).view(np.float32).reshape(n, width)

    def state_apply(self, parsed: RecurrentState, seq_id: int = -1) -> None:
        """Place the cells and copy their rows; StateError with memory unchanged if a sequence
        state does not fit."""
        head = self.state_place(parsed, seq_id)
        self.state_write_data(parsed, head)

    def state_place(self, parsed: RecurrentState, seq_id: int) -> int:
        """Metadata only; returns the first cell of the placed rows. Undone on failure."""
        from kvchat.runtime.batch import UBatch

        n = parsed.pos.shape[0]
        if seq_id < 0:
            self.clear(True)
            c = self.cells
            for i in range(n):
                c.pos[i] = parsed.pos[i]
                for s in parsed.seqs[i]:
                    c.seq[i, s] = True
                    c.tail[s] = i
            c.src[:n] = np.arange(n)
            self.head = 0
            return 0
        snap = self._snapshot()
        self.seq_rm(seq_id, -1, -1)
        if n == 0:
            return 0
        ub = UBatch(
            np.full(n, -1, np.int32),
            parsed.pos.copy(),
            [[seq_id] for _ in range(n)],
            np.zeros(n, bool),
            np.arange(n, dtype=np.int32),
            1,
            True,
        )
        if not self.find_slot(ub):
            self._restore(snap)
            raise StateError(f"failed to find a free cell in the recurrent memory for sequence {seq_id}")
        self.cells.src[self.head : self.head + n] = np.arange(self.head, self.head + n)
        return self.head

    def state_write_data(self, parsed: RecurrentState, head: int) -> None:
        n = parsed.pos.shape[0]
        for il, r, s in zip(self.layers, parsed.r, parsed.s):
            self.r_l[il][head : head + n] = r
            self.s_l[il][head : head + n] = s

    def state_read(self, io: StateReader, seq_id: int = -1) -> None:
        self.state_apply(self.state_parse(io, seq_id), seq_id)
