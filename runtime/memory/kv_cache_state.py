"""KV cache state i/o (llama_kv_cache::state_write / state_read), in llama.cpp's layout.

Per KV cache:
  u32 n_stream
  per stream:  u32 cell_count            (0: nothing follows for this stream)
    cells:     per cell i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
    data:      u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v   (Hadamard chunk sizes, 0 = none)
               per layer: i32 type_k, u64 k_row_bytes, K rows of the cells in cell order
               V, per layer: i32 type_v, u64 v_row_bytes, rows            (flash attention on)
                         or: i32 type_v, u32 elem_bytes, u32 n_embd_v_gqa, then for each of
                             the n_embd_v_gqa V rows the elements of the cells (transposed V)

Reading is two-phase so a bad blob never changes anything: `state_parse` reads and checks
everything (bounds, stream/layer counts, v_trans, types, row sizes, cell_count <= capacity,
sequence ids in range) into arrays; `state_place` puts the cells in (a single sequence goes
through find_slot/apply_ubatch like a normal ubatch, and is undone if it does not fit);
`state_write_data` copies the rows. A pair of caches (iSWA, hybrid) places both before copying
either. The byte stream itself is runtime/memory/state.py's StateWriter / StateReader.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import row_bytes, type_info, type_name
from kvchat.runtime.memory.state import StateError, StateReader, StateWriter

INT_MAX = 2**31 - 1


class StreamState:
    """One stream's parsed cells: pos i32 [n], seqs [[seq ids]] per cell, K/V rows per layer."""

    __slots__ = ("strm", "pos", "seqs", "k", "v")

    def __init__(self, strm, pos, seqs, k, v):
        self.strm, self.pos, self.seqs, self.k, self.v = strm, pos, seqs, k, v


class KVCacheStateIO:
    """State write / parse / place / apply, mixed into KVCache (uses its cells, heads, layers,
    find_slot, apply_ubatch, undo, read/write of rows)."""

    def _selected_cells(self, strm: int, seq_id: int) -> np.ndarray:
        """Cells of a stream to save: all non-empty, or those of seq_id inside its SWA window."""
        cells = self.cells[strm]
        if seq_id < 0:
            return np.flatnonzero(cells.pos >= 0)
        sel = cells.seq[:, seq_id] & (cells.pos >= 0)
        if self.n_swa > 0:
            pmax = cells.seq_pos_max(seq_id)
            sel &= ~((pmax - cells.pos) >= self.n_swa)
        return np.flatnonzero(sel)

    def state_write(self, io: StateWriter, seq_id: int = -1) -> None:
        """Write the cells (all, or one sequence's) and their K/V rows of every stream."""
        if seq_id >= 0:
            self.check_seq(seq_id)
        io.write_u32(self.n_stream)
        for strm in range(self.n_stream):
            if seq_id >= 0 and self.seq_to_stream[seq_id] != strm:
                io.write_u32(0)
                continue
            cells = self.cells[strm]
            idxs = self._selected_cells(strm, seq_id)
            io.write_u32(int(idxs.size))
            if idxs.size == 0:
                continue
            for i in idxs.tolist():
                seqs = [seq_id] if seq_id >= 0 else np.flatnonzero(cells.seq[i]).tolist()
                io.write_i32(int(cells.pos[i]))
                io.write_u32(len(seqs))
                for s in seqs:
                    io.write_i32(int(s))
            io.write_u32(1 if self.v_trans else 0)
            io.write_u32(len(self.layers))
            io.write_u32(self.n_rot_k)  # rows are stored rotated: a reader must rotate alike
            io.write_u32(self.n_rot_v)
            for l in self.layers:
                io.write_i32(self.type_k)
                io.write_u64(row_bytes(self.type_k, l.n_embd_k))
                io.write_array(l.k[strm, idxs])
            for l in self.layers:
                io.write_i32(self.type_v)
                if self.v_trans:
                    io.write_u32(self.v_elem_bytes)
                    io.write_u32(l.n_embd_v)
                    io.write_array(l.v[strm][:, self.trans_cols(idxs)])
                else:
                    io.write_u64(row_bytes(self.type_v, l.n_embd_v))
                    io.write_array(l.v[strm, idxs])

    def state_parse(self, io: StateReader, seq_id: int = -1) -> list[StreamState]:
        """Read and fully validate this cache's state; nothing here changes."""
        name = f"KV cache{' ' + self.name if self.name else ''}"
        n_stream = io.read_u32()
        if n_stream != self.n_stream:
            raise StateError(f"{name}: n_stream mismatch ({n_stream} saved, {self.n_stream} here)")
        out: list[StreamState] = []
        for s in range(n_stream):
            cell_count = io.read_u32()
            if cell_count == 0:
                continue
            if cell_count > self.kv_size:
                raise StateError(f"{name}: not enough cells ({cell_count} saved > {self.kv_size})")
            pos, seqs = self._parse_cells(io, name, cell_count, seq_id)
            ks, vs = self._parse_rows(io, name, cell_count)
            out.append(StreamState(s, pos, seqs, ks, vs))
        if seq_id >= 0 and len(out) > 1:
            raise StateError(f"{name}: a sequence state holds cells in {len(out)} streams")
        return out

    def _parse_cells(self, io, name, cell_count, seq_id):
        pos = np.empty(cell_count, dtype=np.int32)
        seqs: list[list[int]] = []
        for i in range(cell_count):
            p = io.read_i32()
            n_seq = io.read_u32()
            if p < 0:
                raise StateError(f"{name}: cell {i} has negative position {p}")
            if seq_id >= 0 and n_seq != 1:
                raise StateError(f"{name}: invalid seq_id-agnostic kv cell ({n_seq} sequences)")
            if n_seq > self.n_seq_max:
                raise StateError(f"{name}: cell {i} lists {n_seq} sequences (max {self.n_seq_max})")
            ss = [io.read_i32() for _ in range(n_seq)]
            for x in ss:
                if not 0 <= x < self.n_seq_max:
                    raise StateError(f"{name}: invalid seq_id, {x} is out of range [0, {self.n_seq_max})")
            if len(set(ss)) != len(ss):
                raise StateError(f"{name}: cell {i} lists a sequence twice")
            pos[i] = p
            seqs.append(ss)
        return pos, seqs

    def _parse_rows(self, io, name, cell_count):
        v_trans = io.read_u32()
        n_layer = io.read_u32()
        n_rot_k, n_rot_v = io.read_u32(), io.read_u32()
        if n_layer != len(self.layers):
            raise StateError(f"{name}: mismatched layer count ({n_layer} instead of {len(self.layers)})")
        if bool(v_trans) != self.v_trans or v_trans > 1:
            raise StateError(f"{name}: incompatible V transposition (flash attention setting differs)")
        if (n_rot_k, n_rot_v) != (self.n_rot_k, self.n_rot_v):
            raise StateError(
                f"{name}: incompatible key/value rotation ({n_rot_k}/{n_rot_v} instead of "
                f"{self.n_rot_k}/{self.n_rot_v})"
            )
        ks, vs = [], []
        for l in self.layers:
            t = io.read_i32()
            if t != self.type_k:
                raise StateError(
                    f"{name}: mismatched key type (layer {l.il}: "
                    f"{type_name(t)} saved, {type_info(self.type_k).name} here)"
                )
            rb = io.read_u64()
            if rb != row_bytes(self.type_k, l.n_embd_k):
                raise StateError(f"{name}: mismatched key row size (layer {l.il})")
            ks.append(io.read_array(rb * cell_count, (cell_count, rb)))
        for l in self.layers:
            t = io.read_i32()
            if t != self.type_v:
                raise StateError(
                    f"{name}: mismatched value type (layer {l.il}: "
                    f"{type_name(t)} saved, {type_info(self.type_v).name} here)"
                )
            if self.v_trans:
                el = io.read_u32()
                if el != self.v_elem_bytes:
                    raise StateError(f"{name}: mismatched value element size (layer {l.il})")
                ne = io.read_u32()
                if ne != l.n_embd_v:
                    raise StateError(f"{name}: mismatched GQA embedding size (layer {l.il})")
                vs.append(io.read_array(ne * cell_count * el, (ne, cell_count * el)))
            else:
                rb = io.read_u64()
                if rb != row_bytes(self.type_v, l.n_embd_v):
                    raise StateError(f"{name}: mismatched value row size (layer {l.il})")
                vs.append(io.read_array(rb * cell_count, (cell_count, rb)))
        return ks, vs

    def state_place(self, parsed: list[StreamState], seq_id: int, journal: list) -> list:
        """Put parsed cells in (cells and heads only); returns [(strm, idxs)] per stream.

        Whole state (seq_id < 0): the cache is cleared and cells go to 0..n-1 of each stream.
        One sequence: its old cells are removed (journalled), then the saved ones are placed
        like a ubatch via find_slot/apply_ubatch; if they do not fit, everything is undone and
        StateError raised."""
        from kvchat.runtime.batch import UBatch

        if seq_id < 0:
            self.clear(True)
            placed = []
            for st in parsed:
                cells = self.cells[st.strm]
                for i in range(st.pos.shape[0]):
                    cells.pos_set(i, int(st.pos[i]))
                    for s in st.seqs[i]:
                        cells.seq_add(i, s)
                self.heads[st.strm] = 0
                placed.append((st.strm, np.arange(st.pos.shape[0], dtype=np.int64)))
            return placed

        strm = self.seq_to_stream[seq_id]
        cells = self.cells[strm]
        journal.append(("heads", list(self.heads)))
        journal.append(("cells", strm, cells.cp(cells.cells_of_seq(seq_id, 0, INT_MAX))))
        self.seq_rm(seq_id, -1, -1)
        if not parsed:
            return []
        st = parsed[0]
        n = st.pos.shape[0]
        ub = UBatch(
            np.full(n, -1, np.int32),
            st.pos.copy(),
            [[seq_id] for _ in range(n)],
            np.zeros(n, bool),
            np.arange(n, dtype=np.int32),
            1,
            True,
        )
        sinfo = self.find_slot(ub)
        if sinfo is None:
            self.undo(journal)
            raise StateError(f"failed to find {n} available cells in the KV cache for sequence {seq_id}")
        self.apply_ubatch(sinfo, ub, journal, save_data=True)
        return [(strm, sinfo.idxs[0])]

    def state_write_data(self, parsed: list[StreamState], placed: list) -> None:
        """Copy the parsed K/V rows into the placed cells."""
        for st, (strm, idxs) in zip(parsed, placed):
            self.write_rows(strm, idxs, list(zip(st.k, st.v)))

    def state_apply(self, parsed, seq_id: int = -1) -> None:
        """Place then write. On StateError the cache is unchanged."""
        journal: list = []
        placed = self.state_place(parsed, seq_id, journal)
        self.state_write_data(parsed, placed)

    def state_read(self, io: StateReader, seq_id: int = -1) -> None:
        """Read one state; StateError (and no change) if it is bad or does not fit."""
        self.state_apply(self.state_parse(io, seq_id), seq_id)
