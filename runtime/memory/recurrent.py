"""Recurrent memory (llama-memory-recurrent.cpp): one state cell per sequence, for Mamba-style
and linear-attention layers whose whole past is a fixed-size state.

A pool of mem_size = max(1, n_seq_max) cells. Per recurrent layer two f32 buffers (llama.cpp
keeps type_r = type_s = F32):
  r_l[il]  f32 [mem_size, n_embd_r]   conv state: the last d_conv - 1 inputs of the conv
  s_l[il]  f32 [mem_size, n_embd_s]   SSM / delta-rule state (n_embd_s may be 0: LFM2)
Per cell: pos (the position the state is at, -1 empty), its sequence set, `src` (the row that
holds the cell's data; -1 for a new cell), `src0` (the source row staged for the current
ubatch). Per sequence s: tail[s], the cell holding its state.

`find_slot` (run by prepare() on a copy of the metadata, by apply() for real) gives each
sequence of the ubatch a cell it owns - a sequence sharing its cell after seq_cp gets a new
cell whose source row is the shared one (copy on write) - lines those cells up contiguously at
[head, head + n) by swapping metadata, and picks `rs_z`, a row no cell reads, to be zeroed as
the source of brand-new states. The forward pass then reads each sequence's state from its
src0 row and writes the new one into its cell's row (RecurrentContext.get_r / cpy_r).

A state cannot be cut at an arbitrary position: seq_rm of part of a sequence's tail returns
False (callers restore a checkpoint instead); removing from a position past the state's is a
no-op that succeeds. seq_add / seq_div only move the cell's position.
"""

from __future__ import annotations

import logging

import numpy as np

from kvchat.runtime.memory.interface import Memory, MemoryOpError, MemoryStatus, SeqCheckpoint
from kvchat.runtime.memory.recurrent_context import RecurrentContext
from kvchat.runtime.memory.recurrent_state import RecurrentStateIO

log = logging.getLogger(__name__)

INT_MAX = 2**31 - 1


class RecurrentCells:
    """The cell metadata as arrays (so a snapshot is a handful of copies)."""

    __slots__ = ("pos", "src", "src0", "tail", "seq")

    def __init__(self, size: int, n_seq_max: int):
        self.pos = np.full(size, -1, dtype=np.int32)
        self.src = np.full(size, -1, dtype=np.int32)
        self.src0 = np.full(size, -1, dtype=np.int32)
        self.tail = np.full(size, -1, dtype=np.int32)  # indexed by sequence id
        self.seq = np.zeros((size, n_seq_max), dtype=bool)

    def copy(self) -> "RecurrentCells":
        c = RecurrentCells.__new__(RecurrentCells)
        for name in self.__slots__:
            setattr(c, name, getattr(self, name).copy())
        return c

    def is_empty(self, i: int) -> bool:
        return not self.seq[i].any()

    def n_used(self) -> int:
        return int(np.count_nonzero(self.seq.any(axis=1)))


class MemoryRecurrent(RecurrentStateIO, Memory):
    """Recurrent states of the layers `filter` accepts (default: hparams.is_recurrent)."""

    def __init__(self, hparams, mem_size: int, n_seq_max: int, filter=None):
        if mem_size <= 0:
            raise ValueError(f"mem_size must be positive, got {mem_size}")
        self.hparams = hparams
        self.size = int(mem_size)
        self.n_seq_max = int(n_seq_max)
        self.n_embd_r = int(hparams.n_embd_r())
        self.n_embd_s = int(hparams.n_embd_s())
        self.cells = RecurrentCells(self.size, self.n_seq_max)
        self.head = 0
        self.n = 0  # cells [head, head + n) of the current ubatch
        self.rs_z = -1  # the row zeroed as the source of new states (-1: none needed)
        keep = filter if filter is not None else hparams.is_recurrent
        self.r_l: list[np.ndarray | None] = [None] * hparams.n_layer
        self.s_l: list[np.ndarray | None] = [None] * hparams.n_layer
        for il in range(hparams.n_layer):
            if keep(il):
                self.r_l[il] = np.zeros((self.size, self.n_embd_r), dtype=np.float32)
                self.s_l[il] = np.zeros((self.size, self.n_embd_s), dtype=np.float32)
        self.layers = [il for il in range(hparams.n_layer) if self.r_l[il] is not None]
        log.info("%s", self.log_line())

    # ---- reporting ----------------------------------------------------------------------------

    def memory_type(self) -> str:
        return "llama_memory_recurrent"

    def size_r_bytes(self) -> int:
        return sum(self.r_l[il].nbytes for il in self.layers)

    def size_s_bytes(self) -> int:
        return sum(self.s_l[il].nbytes for il in self.layers)

    def memory_breakdown(self) -> dict:
        r, s = self.size_r_bytes(), self.size_s_bytes()
        return {
            "kind": "recurrent",
            "mem_size": self.size,
            "n_layer": len(self.layers),
            "n_seq_max": self.n_seq_max,
            "type_r": "f32",
            "type_s": "f32",
            "r_bytes": r,
            "s_bytes": s,
            "total_bytes": r + s,
        }

    def log_line(self) -> str:
        r, s = self.size_r_bytes(), self.size_s_bytes()
        mib = 1024.0 * 1024.0
        return (
            f"llama_memory_recurrent: size = {(r + s) / mib:7.2f} MiB ({self.size:6d} cells, "
            f"{len(self.layers):3d} layers, {self.n_seq_max:2d} seqs), "
            f"R (f32): {r / mib:7.2f} MiB, S (f32): {s / mib:7.2f} MiB"
        )

    def get_used(self) -> int:
        return self.cells.n_used()

    # ---- sequence operations ------------------------------------------------------------------

    def check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")

    def clear(self, data: bool = True) -> None:
        self.cells = RecurrentCells(self.size, self.n_seq_max)
        self.head = 0
        self.n = 0
        if data:
            for il in self.layers:
                self.r_l[il].fill(0)
                self.s_l[il].fill(0)

    def _free(self, i: int) -> None:
        c = self.cells
        c.pos[i] = -1
        c.src[i] = -1

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove [p0, p1) of seq_id (-1: every sequence). False (nothing changed) when that
        would cut a state in the middle - a recurrent state holds no earlier positions."""
        p0 = max(p0, 0)
        p1 = INT_MAX if p1 < 0 else p1
        c = self.cells
        if seq_id >= self.n_seq_max or seq_id >= self.size or seq_id < -1:
            return False
        if seq_id >= 0:
            t = int(c.tail[seq_id])
            if t >= 0:
                pos = int(c.pos[t])
                if 0 < p0 <= pos < p1:
                    return False  # partial removal of the tail: impossible
                if p0 <= pos < p1:
                    c.tail[seq_id] = -1
        elif p0 != p1 and (p0 != 0 or p1 != INT_MAX):
            return False  # every sequence: all or nothing
        new_head = self.size
        for i in range(self.size):
            if not p0 <= int(c.pos[i]) < p1:
                continue
            if seq_id < 0:
                c.seq[i] = False
            elif c.seq[i, seq_id]:
                c.seq[i, seq_id] = False
            else:
                continue
            if c.is_empty(i):
                self._free(i)
                new_head = min(new_head, i)
        if seq_id < 0:  # (llama.cpp leaves these tails dangling; its find_slot would assert)
            for s in range(min(self.size, self.n_seq_max)):
                if c.tail[s] >= 0 and not c.seq[c.tail[s], s]:
                    c.tail[s] = -1
        if new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """seq_id_dst shares seq_id_src's state cell (copied on its next write)."""
        self.check_seq(seq_id_src)
        self.check_seq(seq_id_dst)
        if seq_id_src == seq_id_dst or seq_id_src >= self.size or seq_id_dst >= self.size:
            return
        c = self.cells
        td = int(c.tail[seq_id_dst])
        if td >= 0:  # the destination's old state goes
            c.seq[td, seq_id_dst] = False
            c.tail[seq_id_dst] = -1
            if c.is_empty(td):
                self._free(td)
        ts = int(c.tail[seq_id_src])
        if ts >= 0:
            c.seq[ts, seq_id_dst] = True
            c.tail[seq_id_dst] = ts

    def seq_keep(self, seq_id: int) -> None:
        self.check_seq(seq_id)
        c = self.cells
        new_head = self.size
        for i in range(self.size):
            if i != seq_id:
                c.tail[i] = -1
            if not c.seq[i, seq_id]:
                self._free(i)
                c.seq[i] = False
                new_head = min(new_head, i)
            else:
                c.seq[i] = False
                c.seq[i, seq_id] = True
        if new_head < self.head:
            self.head = new_head

    def _tail_cell_in(self, seq_id: int, p0: int, p1: int) -> int:
        if not 0 <= seq_id < self.size:
            return -1
        t = int(self.cells.tail[seq_id])
        if t >= 0 and self.cells.seq[t, seq_id] and p0 <= int(self.cells.pos[t]) < p1:
            return t
        return -1

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift the state's position (a recurrent state has no positions inside)."""
        self.check_seq(seq_id)
        p0, p1 = max(p0, 0), (INT_MAX if p1 < 0 else p1)
        if shift == 0 or p0 == p1:
            return
        t = self._tail_cell_in(seq_id, p0, p1)
        if t >= 0:
            self.cells.pos[t] += shift

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.check_seq(seq_id)
        if d <= 0:
            raise ValueError(f"seq_div: divisor must be positive, got {d}")
        p0, p1 = max(p0, 0), (INT_MAX if p1 < 0 else p1)
        if d == 1 or p0 == p1:
            return
        t = self._tail_cell_in(seq_id, p0, p1)
        if t >= 0:
            self.cells.pos[t] //= d

    def seq_pos_min(self, seq_id: int) -> int:
        self.check_seq(seq_id)
        has = self.cells.seq[:, seq_id]
        return int(self.cells.pos[has].min()) if has.any() else -1

    def seq_pos_max(self, seq_id: int) -> int:
        self.check_seq(seq_id)
        has = self.cells.seq[:, seq_id]
        return int(self.cells.pos[has].max()) if has.any() else -1

    def get_can_shift(self) -> bool:
        return True  # only positions move

    def kv_caches(self) -> list:
        return []  # states, no KV cells

    def get_can_trim(self) -> bool:
        return False  # a state cannot lose its last positions (seq_rm of a tail is refused)

    def seq_checkpoint(self, seq_id: int) -> SeqCheckpoint:
        """The sequence's state now (a sequence state blob of its cell)."""
        from kvchat.runtime.memory.state import StateWriter

        io = StateWriter()
        self.state_write(io, seq_id)
        return SeqCheckpoint(seq_id, self.seq_pos_max(seq_id), io.getvalue())

    def seq_restore(self, seq_id: int, ckpt: SeqCheckpoint) -> bool:
        from kvchat.runtime.memory.state import StateError, StateReader

        try:
            io = StateReader(ckpt.blob)
            parsed = self.state_parse(io, seq_id)
            io.expect_end()
            self.state_apply(parsed, seq_id)
        except StateError:
            return False
        return True

    # ---- slots --------------------------------------------------------------------------------

    def find_slot(self, ubatch) -> bool:
        """Give every sequence of the ubatch a cell it owns, contiguous at [head, head + n)."""
        c, size = self.cells, self.size
        n_seqs, n_st = ubatch.n_seqs, ubatch.n_seq_tokens
        if not ubatch.equal_seqs or n_seqs * n_st != ubatch.n_tokens:
            raise MemoryOpError("a recurrent memory needs ubatches of equal sequences")
        used = c.n_used()
        if self.head > used + 2 * n_seqs:
            self.head = 0
        first = [ubatch.seq_id[s * n_st] for s in range(n_seqs)]
        for sids in first:
            for j, sid in enumerate(sids):
                if not 0 <= sid < size:
                    log.error("find_slot: seq_id=%d >= n_seq_max=%d", sid, self.n_seq_max)
                    return False
                if j > 0 and c.tail[sid] >= 0:  # sequences that become shared lose their cell
                    t = int(c.tail[sid])
                    c.seq[t, sid] = False
                    c.tail[sid] = -1
                    if c.is_empty(t):
                        self._free(t)
        empty = ~c.seq.any(axis=1)

        def next_empty(start: int) -> int:
            for k in range(size):
                i = (start + k) % size
                if empty[i]:
                    return i
            return -1

        nxt = next_empty(self.head)
        lo, hi = size - 1, 0
        for s, sids in enumerate(first):
            sid = sids[0]
            t = int(c.tail[sid])
            owns = t >= 0 and int(np.count_nonzero(c.seq[t])) == 1
            if not owns:
                if nxt < 0:
                    return False
                if t >= 0:  # copy on write: the new cell starts from the shared state
                    c.pos[nxt], c.src[nxt] = c.pos[t], c.src[t]
                    c.seq[t, sid] = False
                c.seq[nxt, sid] = True
                empty[nxt] = False
                c.tail[sid] = nxt
                t = nxt
                if s + 1 < n_seqs:
                    nxt = next_empty(nxt + 1)
            lo, hi = min(lo, t), max(hi, t)
        for s, sids in enumerate(first):  # line the cells up at [lo, lo + n_seqs)
            dst, src = lo + s, int(c.tail[sids[0]])
            if dst != src:
                for a in (c.pos, c.src):
                    a[dst], a[src] = a[src], a[dst]
                c.seq[[dst, src]] = c.seq[[src, dst]]
                td, ts = c.tail == dst, c.tail == src
                c.tail[td], c.tail[ts] = src, dst
        for s, sids in enumerate(first):
            cell = lo + s
            last_pos = int(ubatch.pos[s * n_st + n_st - 1])
            if c.pos[cell] >= 0 and last_pos != c.pos[cell] + n_st:
                log.warning(
                    "find_slot: non-consecutive position %d after %d for sequence %d",
                    last_pos,
                    int(c.pos[cell]),
                    sids[0],
                )
            c.pos[cell] = last_pos
            c.seq[cell] = False
            for sid in sids:
                c.seq[cell, sid] = True
                c.tail[sid] = cell
        hi = max(hi, lo + n_seqs - 1)
        refs = np.zeros(size, dtype=np.int64)  # a row no cell reads becomes the zero state
        for i in range(size):
            if c.src[i] >= 0:
                refs[c.src[i]] += 1
        self.rs_z = next((i for i in range(lo, hi + 1) if refs[i] == 0), -1)
        for i in range(lo, hi + 1):
            if c.src[i] < 0:
                if self.rs_z < 0:
                    raise MemoryOpError("recurrent find_slot: no row to hold a new state")
                c.src0[i] = self.rs_z
            else:
                c.src0[i] = c.src[i]
            c.src[i] = i
        self.head, self.n = lo, hi - lo + 1
        return self.n >= n_seqs

    def _snapshot(self):
        return self.cells.copy(), self.head, self.n, self.rs_z

    def _restore(self, snap) -> None:
        cells, self.head, self.n, self.rs_z = snap
        self.cells = cells.copy()

    def prepare(self, ubatches) -> bool:
        """find_slot for every ubatch in turn on the real metadata, then restore it all."""
        snap = self._snapshot()
        try:
            return all(self.find_slot(ub) for ub in ubatches)
        finally:
            self._restore(snap)

    # ---- memory contexts ----------------------------------------------------------------------

    def split_ubatches(self, balloc, n_ubatch: int, embd_all: bool):
        """Equal splits, sequential in seq id as llama.cpp's; a batch with tokens shared by
        several sequences (a prompt decoded once for -np N) takes the non-sequential equal
        split, which llama.cpp refuses for recurrent memories - find_slot handles shared
        tokens (the sequences then share one state cell)."""
        balloc.split_reset()
        sequential = not balloc.has_cpl
        ubatches = []
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, sequential)
            if ub is None:
                break
            ubatches.append(ub)
        return ubatches if balloc.get_n_used() >= balloc.get_n_tokens() else None

    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False) -> "RecurrentContext":
        ubatches = self.split_ubatches(balloc, n_ubatch, embd_all)
        if ubatches is None or not self.prepare(ubatches):
            return RecurrentContext(self, MemoryStatus.FAILED_PREPARE)
        return RecurrentContext(self, MemoryStatus.SUCCESS, ubatches)

    def init_full(self) -> "RecurrentContext":
        return RecurrentContext(self, MemoryStatus.SUCCESS, full=True)

    def init_update(self, optimize: bool = False) -> "RecurrentContext":
        return RecurrentContext(self, MemoryStatus.NO_UPDATE)  # nothing is ever deferred
