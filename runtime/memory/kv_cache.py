"""The KV cache (llama-kv-cache.cpp): K/V tensors per layer plus per-stream cell bookkeeping.

Storage, per cached layer (numpy, zero-filled):
  K  u8 [n_stream, kv_size, row_bytes(type_k, n_embd_k_gqa)]
  V  u8 [n_stream, kv_size, row_bytes(type_v, n_embd_v_gqa)]          flash attention on
     u8 [n_stream, n_embd_v_gqa, kv_size * elem_bytes(type_v)]        flash off (V transposed)
A stream is an independent cell pool: one when the cache is unified, else one per sequence.

Placing a ubatch: `find_slot` picks cells (a ring scan from the stream head; a cell is usable
if empty, or held by one sequence and outside that sequence's sliding window), `apply_ubatch`
writes pos/seq into them. `prepare` runs find_slot+apply over all ubatches of a batch and then
undoes everything (a dry run); `KVCacheContext.apply` does it for real, one ubatch at a time,
keeping an undo journal so a failed decode can restore memory exactly (cells, heads, and the
K/V rows of overwritten SWA cells).
"""

from __future__ import annotations

import logging

import numpy as np

from kvchat.kernels.ggml_types import row_bytes, type_info
from kvchat.runtime.memory.attn_rotation import rotation_sizes
from kvchat.runtime.memory.interface import Memory, MemoryOpError, MemoryStatus
from kvchat.runtime.memory.kv_cache_context import KVCacheContext
from kvchat.runtime.memory.kv_cache_seq import KVCacheSeqOps
from kvchat.runtime.memory.kv_cache_state import KVCacheStateIO
from kvchat.runtime.memory.kv_cells import KVCells

log = logging.getLogger(__name__)

N_KV_PAD = 256  # n_kv is padded to this so the attention shapes change rarely


def is_masked_swa(n_swa: int, p0: int, p1: int) -> bool:
    """LLAMA_SWA_TYPE_STANDARD: cell at p0 is outside the window of a token at p1."""
    return n_swa > 0 and p1 - p0 >= n_swa


class SlotInfo:
    """Where one ubatch goes: per stream s, the stream id strm[s] and cell indices idxs[s]."""

    __slots__ = ("s0", "s1", "strm", "idxs")

    def __init__(self, strm: list[int], idxs: list[np.ndarray]):
        self.strm = strm
        self.idxs = idxs  # list of i64 [n_tokens_per_stream]
        self.s0 = min(strm) if strm else 0
        self.s1 = max(strm) if strm else 0

    def n_stream(self) -> int:
        return len(self.strm)

    def size(self) -> int:
        return int(self.idxs[0].shape[0]) if self.idxs else 0

    def empty(self) -> bool:
        return not self.idxs

    def is_contiguous(self) -> bool:
        i = self.idxs[0]
        return i.size == 0 or int(i[-1]) - int(i[0]) + 1 == i.size

    def head(self) -> int:
        return int(self.idxs[0][0])

    def __repr__(self) -> str:
        return f"SlotInfo(strm={self.strm}, idxs={[i.tolist() for i in self.idxs]})"


class KVLayer:
    """The K/V storage of one cached layer."""

    __slots__ = ("il", "k", "v", "n_embd_k", "n_embd_v")

    def __init__(self, il, k, v, n_embd_k, n_embd_v):
        self.il, self.k, self.v, self.n_embd_k, self.n_embd_v = il, k, v, n_embd_k, n_embd_v


def _elem_bytes(t: int) -> int:
    return type_info(t).type_size if type_info(t).block_size == 1 else 0


class KVCache(KVCacheSeqOps, KVCacheStateIO, Memory):
    """A KV cache over the layers `filter` accepts (default: every layer with a KV)."""

    def __init__(
        self,
        hparams,
        type_k: int,
        type_v: int,
        v_trans: bool,
        unified: bool,
        kv_size: int,
        n_seq_max: int,
        n_swa: int = 0,
        filter=None,
        reuse=None,
        name: str = "",
    ):
        if kv_size <= 0:
            raise ValueError(f"kv_size must be positive, got {kv_size}")
        self.hparams = hparams
        self.type_k = int(type_k)
        self.type_v = int(type_v)
        self.v_trans = bool(v_trans)
        self.n_seq_max = int(n_seq_max)
        self.n_stream = 1 if unified else self.n_seq_max
        self.kv_size = int(kv_size)
        self.n_swa = int(n_swa)
        self.name = name
        self.v_elem_bytes = _elem_bytes(self.type_v)  # bytes per transposed-V element (0: blocks)
        if self.v_trans and self.v_elem_bytes == 0:
            raise MemoryOpError("quantized V cache was requested, but this requires Flash Attention")
        # Hadamard chunk sizes for Q/K and V (0 = none): the forward pass rotates what it
        # stores, the K-shift undoes and redoes it, and saved state records it.
        self.n_rot_k, self.n_rot_v = rotation_sizes(hparams, self.type_k, self.type_v)

        self.cells = [KVCells(self.kv_size, self.n_seq_max) for _ in range(self.n_stream)]
        self.heads = [0] * self.n_stream
        self.seq_to_stream = [0] * self.n_seq_max if self.n_stream == 1 else list(range(self.n_seq_max))
        self.pending_copies: list[tuple[int, int]] = []  # (src stream, dst stream)

        self.layers: list[KVLayer] = []
        self.map_layer_ids: dict[int, int] = {}
        ns, size = self.n_stream, self.kv_size
        for il in range(hparams.n_layer):
            if not hparams.has_kv(il) or (filter is not None and not filter(il)):
                continue
            nk, nv = hparams.n_embd_k_gqa(il), hparams.n_embd_v_gqa(il)
            k = np.zeros((ns, size, row_bytes(self.type_k, nk)), dtype=np.uint8)
            if self.v_trans:
                v = np.zeros((ns, nv, size * _elem_bytes(self.type_v)), dtype=np.uint8)
            else:
                v = np.zeros((ns, size, row_bytes(self.type_v, nv)), dtype=np.uint8)
            self.map_layer_ids[il] = len(self.layers)
            self.layers.append(KVLayer(il, k, v, nk, nv))
        if reuse is not None:
            for il in range(hparams.n_layer):
                src = reuse(il)
                if src < 0 or (filter is not None and not filter(il)):
                    continue
                if src not in self.map_layer_ids:
                    raise ValueError(f"layer {il} reuses layer {src}, which has no cache here")
                self.map_layer_ids[il] = self.map_layer_ids[src]
        # il -> KVLayer (None for layers this cache does not hold): the forward pass's lookup
        self.layer_of = [
            self.layers[self.map_layer_ids[il]] if il in self.map_layer_ids else None for il in range(hparams.n_layer)
        ]
        log.info("%s", self.log_line())

    # ---- geometry / reporting ---------------------------------------------------------------

    def get_size(self) -> int:
        return self.kv_size

    def get_n_stream(self) -> int:
        return self.n_stream

    def size_k_bytes(self) -> int:
        return sum(l.k.nbytes for l in self.layers)

    def size_v_bytes(self) -> int:
        return sum(l.v.nbytes for l in self.layers)

    def memory_breakdown(self) -> dict:
        k, v = self.size_k_bytes(), self.size_v_bytes()
        return {
            "kv_size": self.kv_size,
            "n_layer": len(self.layers),
            "n_seq_max": self.n_seq_max,
            "n_stream": self.n_stream,
            "type_k": type_info(self.type_k).name,
            "type_v": type_info(self.type_v).name,
            "k_bytes": k,
            "v_bytes": v,
            "total_bytes": k + v,
        }

    def memory_type(self) -> str:
        return "llama_kv_cache"

    def kv_caches(self) -> list:
        return [self]

    def log_line(self) -> str:
        """The llama.cpp form of the cache-size log line."""
        k, v = self.size_k_bytes(), self.size_v_bytes()
        mib = 1024.0 * 1024.0
        return (
            f"llama_kv_cache{'_' + self.name if self.name else ''}: size = {(k + v) / mib:7.2f} MiB "
            f"({self.kv_size:6d} cells, {len(self.layers):3d} layers, "
            f"{self.n_seq_max:2d}/{self.n_stream} seqs), "
            f"K ({type_info(self.type_k).name}): {k / mib:7.2f} MiB, "
            f"V ({type_info(self.type_v).name}): {v / mib:7.2f} MiB"
        )

    def layer(self, il: int) -> KVLayer:
        return self.layers[self.map_layer_ids[il]]

    def get_cells(self, seq_id: int) -> KVCells:
        return self.cells[self.seq_to_stream[seq_id]]

    def check_seq(self, seq_id: int) -> None:
        """ValueError unless 0 <= seq_id < n_seq_max (every per-sequence operation's precondition)."""
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")

    # ---- slots ------------------------------------------------------------------------------

    def _usable(self, cells: KVCells) -> np.ndarray:
        """bool [kv_size]: cells find_slot may take (empty, or single-seq and SWA-masked)."""
        usable = cells.pos < 0
        if self.n_swa > 0:
            cand = np.flatnonzero(cells.nseq == 1)
            if cand.size:
                seq_of = np.argmax(cells.seq[cand], axis=1)
                pmax = np.array([cells.seq_pos_max(int(s)) for s in range(self.n_seq_max)], dtype=np.int64)
                masked = (pmax[seq_of] + 1) - cells.pos[cand] >= self.n_swa
                usable[cand[masked]] = True
        return usable

    def find_slot(self, ubatch) -> SlotInfo | None:
        """Cells for the ubatch (non-contiguous allowed), per stream; None if it does not fit."""
        n_tokens = ubatch.n_tokens
        n_seqs = 1
        if self.n_stream > 1:
            n_seqs = ubatch.n_seqs_unq
            if n_tokens % n_seqs != 0:
                raise MemoryOpError("a multi-stream ubatch must give every sequence equal tokens")
            n_tokens //= n_seqs
        strms, idxs_all = [], []
        for s in range(n_seqs):
            seq_id = ubatch.seq_id_unq[s]
            strm = self.seq_to_stream[seq_id]
            cells = self.cells[strm]
            size = cells.size
            if n_tokens > size:
                log.error("find_slot: n_tokens = %d > size = %d", n_tokens, size)
                return None
            head = self.heads[strm]
            # enough free cells before the head: restart from 0, hoping to fill the start
            if head > cells.n_used + 2 * n_tokens:
                head = 0
            if head + n_tokens <= size and bool(np.all(cells.pos[head : head + n_tokens] < 0)):
                idxs = np.arange(head, head + n_tokens, dtype=np.int64)  # the common case
            else:
                usable = self._usable(cells)
                ring = np.concatenate((usable[head:], usable[:head]))
                nz = np.flatnonzero(ring)[:n_tokens]
                if nz.size < n_tokens:
                    return None
                idxs = (nz + head) % size
            strms.append(strm)
            idxs_all.append(idxs)
        return SlotInfo(strms, idxs_all)

    def apply_ubatch(self, sinfo: SlotInfo, ubatch, journal: list | None = None, save_data: bool = False) -> None:
        """Write the ubatch's positions and sequences into the slot cells and move the heads.

        With `journal`, append what is needed to undo this exactly (see `undo`); `save_data`
        also keeps the K/V rows of overwritten (SWA-masked) cells, which the forward pass is
        about to replace."""
        if journal is not None:
            journal.append(("heads", list(self.heads)))
        seq_pos_max_rm: dict[int, int] = {}
        n_per = sinfo.size()
        for s in range(sinfo.n_stream()):
            strm = sinfo.strm[s]
            cells = self.cells[strm]
            idxs = sinfo.idxs[s]
            if journal is not None:
                journal.append(("cells", strm, cells.cp(idxs)))
            occupied = idxs[cells.pos[idxs] >= 0]
            if occupied.size:
                if journal is not None and save_data:
                    journal.append(("data", strm, occupied.copy(), self.read_rows(strm, occupied)))
                for i in occupied.tolist():
                    sid = cells.seq_get(i)
                    p = int(cells.pos[i])
                    if p > seq_pos_max_rm.get(sid, -1):
                        seq_pos_max_rm[sid] = p
                    cells.rm(i)
            lo = s * n_per
            pos = ubatch.pos[lo : lo + n_per].tolist()
            tok = ubatch.token[lo : lo + n_per].tolist()
            seqs = ubatch.seq_id[lo : lo + n_per]
            for ii, i in enumerate(idxs.tolist()):
                cells.pos_set(i, pos[ii])
                cells.ext_set(i, tok[ii])
                for sid in seqs[ii]:
                    cells.seq_add(i, sid)
        # keep every sequence's positions one contiguous range: purge what lies below an
        # overwritten position (only happens in SWA caches)
        for sid, pmax in seq_pos_max_rm.items():
            cells = self.cells[self.seq_to_stream[sid]]
            pmin = cells.seq_pos_min(sid)
            if 0 <= pmin <= pmax:
                log.debug("purging positions [%d, %d] of sequence %d", pmin, pmax, sid)
                if journal is not None:
                    strm = self.seq_to_stream[sid]
                    journal.append(("cells", strm, cells.cp(cells.cells_of_seq(sid, pmin, pmax + 1))))
                self.seq_rm(sid, pmin, pmax + 1)
        for s in range(sinfo.n_stream()):
            self.heads[sinfo.strm[s]] = int(sinfo.idxs[s][-1]) + 1

    def undo(self, journal: list) -> None:
        """Revert the changes recorded in a journal (newest first)."""
        for rec in reversed(journal):
            kind = rec[0]
            if kind == "cells":
                self.cells[rec[1]].set(rec[2])
            elif kind == "heads":
                self.heads[:] = rec[1]
            elif kind == "data":
                self.write_rows(rec[1], rec[2], rec[3])
        journal.clear()

    def prepare(self, ubatches) -> list[SlotInfo] | None:
        """find_slot for every ubatch as if the earlier ones were placed; memory unchanged.
        The last ubatch is not placed: no later search depends on it (a generated token's
        ubatch is found without a place-and-undo)."""
        res: list[SlotInfo] = []
        journal: list = []
        ok = True
        try:
            for i, ub in enumerate(ubatches):
                sinfo = self.find_slot(ub)
                if sinfo is None:
                    ok = False
                    break
                res.append(sinfo)
                if i + 1 < len(ubatches):
                    self.apply_ubatch(sinfo, ub, journal)
        finally:
            self.undo(journal)
        return res if ok else None

    def get_n_kv(self, sinfo: SlotInfo) -> int:
        n = 0
        for strm in sinfo.strm:
            cells = self.cells[strm]
            padded = -(-cells.used_max_p1() // N_KV_PAD) * N_KV_PAD
            n = max(n, min(cells.size, max(N_KV_PAD, padded)))
        return n

    # ---- raw row access (undo journal, state i/o, compaction) -------------------------------

    def read_rows(self, strm: int, idxs: np.ndarray) -> list:
        """[(K rows, V rows) per layer]: copies of the data of cells idxs of a stream (V as
        the transposed columns when v_trans)."""
        out = []
        for l in self.layers:
            v = l.v[strm][:, self.trans_cols(idxs)] if self.v_trans else l.v[strm, idxs]
            out.append((l.k[strm, idxs].copy(), v.copy()))
        return out

    def write_rows(self, strm: int, idxs: np.ndarray, data: list) -> None:
        """Store what read_rows returned (or parsed state rows) into cells idxs of a stream."""
        for l, (k, v) in zip(self.layers, data):
            l.k[strm, idxs] = k
            if self.v_trans:
                l.v[strm][:, self.trans_cols(idxs)] = v
            else:
                l.v[strm, idxs] = v

    def trans_cols(self, idxs: np.ndarray) -> np.ndarray:
        """Byte columns of cells idxs in a transposed V row (el bytes per cell)."""
        el = self.v_elem_bytes
        return (np.asarray(idxs, dtype=np.int64)[:, None] * el + np.arange(el)).reshape(-1)

    # ---- memory contexts --------------------------------------------------------------------

    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False) -> "KVCacheContext":
        balloc.split_reset()
        ubatches = []
        while True:
            ub = balloc.split_simple(n_ubatch) if self.n_stream == 1 else balloc.split_equal(n_ubatch, True)
            if ub is None:
                break
            ubatches.append(ub)
        if balloc.get_n_used() < balloc.get_n_tokens():
            return KVCacheContext(self, MemoryStatus.FAILED_PREPARE)
        sinfos = self.prepare(ubatches)
        if sinfos is None:
            return KVCacheContext(self, MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, MemoryStatus.SUCCESS, sinfos, ubatches)

    def init_full(self) -> "KVCacheContext":
        ctx = KVCacheContext(self, MemoryStatus.SUCCESS)
        ctx.n_kv = self.kv_size
        return ctx

    def init_update(self, optimize: bool = False) -> "KVCacheContext":
        do_shift = self.get_has_shift()
        do_defrag = optimize and self._fragmented()
        if not do_shift and not self.pending_copies and not do_defrag:
            return KVCacheContext(self, MemoryStatus.NO_UPDATE)
        ctx = KVCacheContext(self, MemoryStatus.SUCCESS)
        ctx.update = (do_shift, do_defrag)
        return ctx

    def get_has_shift(self) -> bool:
        return any(c.get_has_shift() for c in self.cells)

    def get_can_shift(self) -> bool:
        cs = getattr(self.hparams, "can_shift", True)
        return bool(cs() if callable(cs) else cs)

    def update(self, do_shift: bool, do_defrag: bool = False) -> bool:
        """Apply pending stream copies, the K-shift and (optionally) compaction."""
        from kvchat.runtime.memory.kv_update import apply_k_shift, compact, copy_streams

        updated = False
        if self.pending_copies:
            copy_streams(self, self.pending_copies)
            self.pending_copies.clear()
            updated = True
        if do_shift:
            if not self.get_can_shift():
                raise MemoryOpError(
                    "the current KV cache / model configuration does not support "
                    "K-shift (context shift); use --swa-full or stop at the limit"
                )
            apply_k_shift(self)
            for c in self.cells:
                c.reset_shift()
            updated = True
        if do_defrag:
            updated = compact(self) or updated
        return updated

    def _fragmented(self) -> bool:
        return any(c.used_max_p1() > c.get_used() for c in self.cells)
