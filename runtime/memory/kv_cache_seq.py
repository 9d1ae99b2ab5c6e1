"""The KV cache's sequence operations (llama_kv_cache::seq_*), mixed into KVCache: clear,
seq_rm / seq_cp / seq_keep / seq_add / seq_div, seq_pos_min / seq_pos_max. They edit cell
metadata only (positions, sequence sets, pending shifts, heads); K/V rows follow at the next
update (stream copies, K-shift) or are simply left for the next writer.
"""

from __future__ import annotations

from kvchat.runtime.memory.interface import MemoryOpError

INT_MAX = 2**31 - 1


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's seq_* convention: p0 < 0 means from 0, p1 < 0 means to the end."""
    return max(p0, 0), (INT_MAX if p1 < 0 else p1)


class KVCacheSeqOps:
    """Uses KVCache's cells, heads, seq_to_stream, pending_copies, layers, check_seq."""

    def clear(self, data: bool = True) -> None:
        for s in range(self.n_stream):
            self.cells[s].reset()
            self.heads[s] = 0
        self.pending_copies.clear()
        if data:
            for l in self.layers:
                l.k.fill(0)
                l.v.fill(0)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions [p0, p1) of seq_id (-1 = every sequence; p < 0 = open end)."""
        if seq_id < -1:
            raise ValueError(f"seq_id {seq_id} out of range (-1 = every sequence)")
        p0, p1 = pos_range(p0, p1)
        if seq_id >= 0:
            self.check_seq(seq_id)
            strm = self.seq_to_stream[seq_id]
            cells = self.cells[strm]
            new_head = -1
            for i in cells.cells_of_seq(seq_id, p0, p1).tolist():
                if cells.seq_rm(i, seq_id) and new_head < 0:
                    new_head = i
            if 0 <= new_head < self.heads[strm]:
                self.heads[strm] = new_head
        else:
            for strm, cells in enumerate(self.cells):
                idxs = cells.cells_in_range(p0, p1).tolist()
                for i in idxs:
                    cells.rm(i)
                if idxs and idxs[0] < self.heads[strm]:
                    self.heads[strm] = idxs[0]
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make seq_id_dst share the cells of seq_id_src in [p0, p1) (same stream), or copy the
        whole stream (different streams; the buffer copy happens at the next update)."""
        self.check_seq(seq_id_src)
        self.check_seq(seq_id_dst)
        s0, s1 = self.seq_to_stream[seq_id_src], self.seq_to_stream[seq_id_dst]
        if s0 == s1:
            if seq_id_src == seq_id_dst:
                return
            p0, p1 = pos_range(p0, p1)
            cells = self.cells[s0]
            for i in cells.cells_of_seq(seq_id_src, p0, p1).tolist():
                if not cells.seq_has(i, seq_id_dst):
                    cells.seq_add(i, seq_id_dst)
            return
        if (p0 > 0 and p0 + 1 < self.kv_size) or (p1 > 0 and p1 + 1 < self.kv_size):
            raise MemoryOpError("seq_cp() between streams is only supported for whole sequences")
        self.pending_copies.append((s0, s1))
        src, dst = self.cells[s0], self.cells[s1]
        dst.reset()
        for i in src.cells_of_seq(seq_id_src, 0, INT_MAX).tolist():
            shift = int(src.shift[i])
            dst.pos_set(i, int(src.pos[i]) - shift)
            dst.seq_add(i, seq_id_dst)
            if shift:
                dst.pos_add(i, shift)
            dst.ext_set(i, int(src.ext[i]))
        self.heads[s1] = self.heads[s0]

    def seq_keep(self, seq_id: int) -> None:
        self.check_seq(seq_id)
        strm = self.seq_to_stream[seq_id]
        cells = self.cells[strm]
        new_head = -1
        for i in cells.used_cells().tolist():
            if cells.seq_keep(i, seq_id) and new_head < 0:
                new_head = i
        if 0 <= new_head < self.heads[strm]:
            self.heads[strm] = new_head

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add `shift` to the positions in [p0, p1) of seq_id (cells falling below 0 are freed);
        the keys are re-rotated at the next update (K-shift)."""
        self.check_seq(seq_id)
        if shift == 0:
            return
        p0, p1 = pos_range(p0, p1)
        if p0 == p1:
            return
        strm = self.seq_to_stream[seq_id]
        cells = self.cells[strm]
        new_head = -1
        for i in cells.cells_of_seq(seq_id, p0, p1).tolist():
            if cells.pos_add(i, shift) and new_head < 0:
                new_head = i
        self.heads[strm] = new_head if new_head >= 0 else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.check_seq(seq_id)
        if d == 1:
            return
        if d <= 0:
            raise ValueError(f"seq_div: divisor must be positive, got {d}")
        p0, p1 = pos_range(p0, p1)
        if p0 == p1:
            return
        cells = self.cells[self.seq_to_stream[seq_id]]
        for i in cells.cells_of_seq(seq_id, p0, p1).tolist():
            cells.pos_div(i, d)

    def seq_pos_min(self, seq_id: int) -> int:
        self.check_seq(seq_id)
        return self.cells[self.seq_to_stream[seq_id]].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        self.check_seq(seq_id)
        return self.cells[self.seq_to_stream[seq_id]].seq_pos_max(seq_id)
