"""The KV cache's memory context (llama_kv_cache_context): one batch's ubatches with their
slots, and the view of the cache that the forward pass of an attention layer uses.

`apply()` places the current ubatch (journalled, so `rollback()` restores the cells, heads and
the rows of overwritten SWA cells exactly); `cpy_k/cpy_v` quantize the ubatch's K/V rows into
its cells, `get_k/get_v` are views over the first n_kv cells, `kq_mask` is built once per
ubatch. It implements `AttentionMemoryContext` (runtime/memory/interface.py).
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.kv_kernels import (
    build_kq_mask,
    build_kq_mask_par,
    scatter_rows,
    scatter_rows_par,
    scatter_rows_trans,
)
from kvchat.runtime.memory.interface import AttnIO, KVStore, MemoryContext, MemoryOpError, MemoryStatus
from kvchat.runtime.memory.kv_view import plan_view

PAR_MASK_MIN = 1 << 18  # mask entries above which building it in parallel pays off
PAR_ROWS_MIN = 64  # rows above which quantize-scatter runs in parallel


class KVCacheContext(MemoryContext):
    """A batch's ubatches with their slots; the view of the cache the forward pass uses."""

    def __init__(self, kv, status: MemoryStatus, sinfos=None, ubatches=None):
        self.kv = kv
        self.status = status
        self.sinfos = sinfos or []
        self.ubatches = ubatches or []
        self.i_cur = 0
        self.n_kv = 0
        self.update = None  # (do_shift, do_defrag) for an update context
        self.journal: list = []  # undo records of every ubatch applied so far
        self.type_k = kv.type_k
        self.type_v = kv.type_v
        self.v_trans = kv.v_trans
        self.n_rot_k, self.n_rot_v = kv.n_rot_k, kv.n_rot_v
        self._mask = None
        self._start = None
        self._view = False  # position view of the current ubatch: False = not planned yet
        self._dst_strm = None
        self._dst_cell = None

    # ---- MemoryContext ----------------------------------------------------------------------

    def next(self) -> bool:
        self.i_cur += 1
        self._mask = None
        self._start = None
        self._view = False
        return self.i_cur < len(self.ubatches)

    def apply(self) -> bool:
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise MemoryOpError("apply() on a failed memory context")
        if not self.ubatches:
            if self.update is not None:
                self.kv.update(*self.update)
            return True
        sinfo = self.sinfos[self.i_cur]
        ub = self.ubatches[self.i_cur]
        self.kv.apply_ubatch(sinfo, ub, self.journal, save_data=True)
        self.n_kv = self.kv.get_n_kv(sinfo)
        n_per = sinfo.size()
        if sinfo.n_stream() == 1:
            self._dst_strm = np.full(ub.n_tokens, sinfo.strm[0], dtype=np.int64)
            self._dst_cell = sinfo.idxs[0]
        else:
            self._dst_strm = np.repeat(np.asarray(sinfo.strm, dtype=np.int64), n_per)
            self._dst_cell = np.concatenate(sinfo.idxs)
        self._mask = None
        self._start = None
        self._view = False
        return True

    def rollback(self) -> None:
        """Undo every ubatch applied through this context (a failed or aborted decode)."""
        self.kv.undo(self.journal)

    def get_ubatch(self):
        return self.ubatches[self.i_cur]

    def get_status(self) -> MemoryStatus:
        return self.status

    # ---- what the forward pass uses ---------------------------------------------------------

    def get_n_kv(self, il: int | None = None) -> int:
        return self.n_kv

    def get_sinfo(self):
        return self.sinfos[self.i_cur]

    def cpy_k(self, il: int, k_cur: np.ndarray) -> None:
        """Store k_cur f32 [n_tokens, n_embd_k_gqa] into the slot cells (cache type_k)."""
        layer = self.kv.layer_of[il]
        x = k_cur
        if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], layer.n_embd_k)
        fn = scatter_rows_par if x.shape[0] >= PAR_ROWS_MIN else scatter_rows
        fn(layer.k, x, self._dst_strm, self._dst_cell, self.type_k)

    def cpy_v(self, il: int, v_cur: np.ndarray) -> None:
        """Store v_cur f32 [n_tokens, n_embd_v_gqa] (transposed when flash attention is off)."""
        layer = self.kv.layer_of[il]
        x = v_cur
        if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], layer.n_embd_v)
        if self.v_trans:
            scatter_rows_trans(layer.v, x, self._dst_strm, self._dst_cell, self.kv.type_v, self.kv.v_elem_bytes)
        else:
            fn = scatter_rows_par if x.shape[0] >= PAR_ROWS_MIN else scatter_rows
            fn(layer.v, x, self._dst_strm, self._dst_cell, self.kv.type_v)

    def get_k(self, il: int):
        """(u8 [n_stream, n_kv, row_bytes_k], type_k) - a view, no copy."""
        return self.kv.layer_of[il].k[:, : self.n_kv], self.type_k

    def get_rot(self, il: int) -> tuple[int, int]:
        """(n_rot_k, n_rot_v): Hadamard chunk sizes the forward pass applies to Q/K and V
        before storing them (runtime/memory/attn_rotation.py); (0, 0) for float caches."""
        return self.n_rot_k, self.n_rot_v

    def get_v(self, il: int):
        """(u8 [n_stream, n_kv, row_bytes_v], type_v); transposed (flash off):
        (u8 [n_stream, n_embd_v_gqa, kv_size * elem_bytes], type_v) - only the first n_kv
        elements of each row are meaningful."""
        layer = self.kv.layer_of[il]
        if self.v_trans:
            return layer.v, self.type_v
        return layer.v[:, : self.n_kv], self.type_v

    def attn_io(self, il: int) -> AttnIO:
        """Everything attention layer il reads and writes for this ubatch, in one call (a
        generated token runs ~30 layers; the forward's per-layer path, runtime/arch/layer_plan.py):
        get_k, get_v, not v_trans, kq_mask, kq_start and get_rot of this layer, and the store
        (KVStore: the layer's K and V arrays and this ubatch's slot cells) where a kernel may
        quantize the fresh rows itself, None when V is stored transposed or K/V are rotated
        first (then use cpy_k / cpy_v). When other sequences' cells share the cache, mask,
        tok_stream and start are those of the ubatch's position view, which the reader gathers
        k and v into (AttnIO.view, runtime/memory/kv_view.py)."""
        layer = self.kv.layer_of[il]
        view = self.position_view()
        if view is None:
            mask, tok_strm = self.kq_mask(il)
            start = self.kq_start(il)
        else:
            mask, tok_strm, start = view.mask, view.tok_stream, None
        n_kv = self.n_kv
        if self.v_trans:
            return AttnIO(
                None,
                layer.k[:, :n_kv],
                self.type_k,
                layer.v,
                self.type_v,
                False,
                mask,
                tok_strm,
                start,
                self.n_rot_k,
                self.n_rot_v,
                view,
            )
        store = None
        if not (self.n_rot_k or self.n_rot_v):
            store = KVStore(layer.k, layer.v, self._dst_strm, self._dst_cell, self.type_k, self.type_v)
        return AttnIO(
            store,
            layer.k[:, :n_kv],
            self.type_k,
            layer.v[:, :n_kv],
            self.type_v,
            True,
            mask,
            tok_strm,
            start,
            self.n_rot_k,
            self.n_rot_v,
            view,
        )

    def position_view(self):
        """The ubatch's position view (runtime/memory/kv_view.py), planned once per ubatch; None
        when the cells are read as they are (one-sequence contexts always)."""
        if self._view is False:
            ub = self.ubatches[self.i_cur]
            self._view = None if self.kv.n_seq_max <= 1 else plan_view(self.kv, self.n_kv, ub, self.kq_mask()[0])
        return self._view

    def kq_mask(self, il: int | None = None):
        """(mask f32 [n_tokens, n_kv] of 0 / -inf, tok_stream i32 [n_tokens]) for this ubatch;
        built once per ubatch (all layers of one cache share it)."""
        if self._mask is None:
            self._mask = self._build_mask()
        return self._mask

    def kq_start(self, il: int | None = None):
        """i64 [n_tokens]: the cell of the oldest position each token sees (0 if none), where
        attention begins its sums (kernels/attention.py: attention's start). Only a sliding-window
        cache reuses cells as a ring, so only there does it differ from the first visible cell;
        elsewhere None (cell 0, as before)."""
        if self.kv.n_swa <= 0:
            return None
        if self._start is None:
            mask, tok_strm = self.kq_mask(il)
            start = np.zeros(mask.shape[0], dtype=np.int64)
            for strm in sorted(set(tok_strm.tolist())):  # np.unique would import numpy.ma
                rows = np.flatnonzero(tok_strm == strm)
                pos = self.kv.cells[strm].pos[: self.n_kv].astype(np.int64)
                seen = np.where(mask[rows] == 0, pos[None, :], np.iinfo(np.int64).max)  # [rows, n_kv]
                start[rows] = np.argmin(seen, axis=1) if self.n_kv else 0
            self._start = start
        return self._start

    def _build_mask(self):
        ub = self.ubatches[self.i_cur]
        n_kv = self.n_kv
        mask = np.empty((ub.n_tokens, n_kv), dtype=np.float32)  # [n_tokens, n_kv]
        tok_strm = self._dst_strm.astype(np.int32)
        for strm in sorted(set(tok_strm.tolist())):  # np.unique would import numpy.ma
            rows = np.flatnonzero(tok_strm == strm)
            cells = self.kv.cells[strm]
            fn = build_kq_mask_par if rows.size * n_kv >= PAR_MASK_MIN else build_kq_mask
            fn(mask, rows, cells.pos, cells.seq, ub.pos, ub.seq0, n_kv, self.kv.n_swa)
        return mask, tok_strm
