"""ggml_mul_mat_id on CPU: a stack of expert matrices, each token multiplied by its chosen ones.

A mixture-of-experts FFN stores each projection of all experts as one 3-D tensor, ggml ne
[k, m, n_expert] (`ffn_{gate,up,down}_exps`): expert e's matrix is rows e*m .. (e+1)*m - 1 of
the file's [n_expert * m, row_bytes] view. ``ExpertMatrix`` repacks each expert's rows as a
QMatrix would (in their own block format, never dequantized; several parts with one format and
row length, e.g. gate and up, are stacked per expert into one matrix) and holds the packed
arrays of all experts stacked, [n_expert, ...] each: one copy of the weights, which the weight
cache (runtime/weights/cache.py) stores and maps as one entry.

``matmul_id(x, ids)`` groups the (token, slot) pairs of a ubatch by expert, so an expert's
weights are read once per ubatch and a decoded token reads only its k experts, and runs all of
them in one launch of kernels/matmul_id_q.py (block-quantized weights: each activation row
quantized once, the work of every expert split over the threads together). Float experts (the
tiny test models) run one QMatrix.matmul per expert on views of the stack. A pair's row is
computed from its own activation row alone, bit-identical to its expert's QMatrix.matmul of that
row, so a token's result is the same whatever else is in the ubatch (batch invariance).
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels import parallel
from kvchat.kernels.cpu import ISA
from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.matmul import _RUNS, TOKEN_CHUNK, QMatrix, call_compiled, release_file_pages
from kvchat.kernels.matmul_id_q import matmul_id_q, matmul_id_q_serial
from kvchat.kernels.qlayout import Packed


def _stacked(parts: list, ms: tuple, t: int, k: int, n_expert: int) -> tuple[str, tuple]:
    """(kind, arrays [n_expert, ...]): each expert's rows (its rows of every part, concatenated)
    repacked as QMatrix does, copied into the stack and released: one expert's packing at a time
    is held next to the stack."""
    kind, out = None, None
    for e in range(n_expert):
        rows = [p[e * m : (e + 1) * m] for p, m in zip(parts, ms)]
        raw = rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)  # [m, row_bytes] u8
        kind, arrays = QMatrix(raw, t, k, keep_raw=False).packing()
        if out is None:
            out = tuple(np.empty((n_expert, *a.shape), a.dtype) for a in arrays)
        for dst, a in zip(out, arrays):
            dst[e] = a
        for r in rows:
            release_file_pages(r)
    return kind, out


class ExpertMatrix:
    """n_expert matrices of m rows by k values (ggml type t), packed and stacked.

    parts: the raw u8 [n_expert * m_i, row_bytes] views of the stacked tensors whose rows are
    concatenated per expert (one part, or gate and up); packed: what ``packing()`` returned (a
    weight-cache hit: the rows are not read), then ms gives the parts' rows per expert."""

    def __init__(self, parts: list, t: int, k: int, n_expert: int, *, packed=None, ms=None):
        self.t, self.k, self.n_expert = int(t), int(k), int(n_expert)
        self.ms = tuple(int(m) for m in ms) if ms is not None else tuple(p.shape[0] // n_expert for p in parts)
        self.m = sum(self.ms)
        self.kind, self._stack = packed if packed is not None else _stacked(parts, self.ms, t, k, n_expert)
        self._stack = tuple(self._stack)
        # float weights: a QMatrix per expert on views of the stack (no copy)
        self.experts = [
            QMatrix(None, t, k, keep_raw=False, packed=(self.kind, tuple(a[e] for a in self._stack)), m=self.m)
            for e in range(self.n_expert)
        ]
        self.fmt = self.experts[0].fmt if self.experts else None  # None: float weights
        self.nbytes = self.n_expert * self.m * row_bytes(self.t, self.k)  # bytes in the file
        self.expert_nbytes = self.nbytes // max(self.n_expert, 1)  # what one routed token reads of it
        self.packed_nbytes = int(sum(a.nbytes for a in self._stack))
        if self.fmt is not None:
            self.experts = []  # the integer kernel reads the stack itself
            self._args = (ISA, self.fmt, *Packed(*self._stack))
        self._macs_per_pair = self.m * self.k
        self._entry: dict = {}  # kernel -> its compiled entry point for this matrix (matmul.call_compiled)
        self._slot_index: dict = {}  # n_used -> (zeros, 0 .. n_used - 1, 0 .. n_used) i64: one token's pairs

    def __repr__(self) -> str:
        return f"ExpertMatrix({GGMLType(self.t).name}, n_expert={self.n_expert}, m={self.m}, k={self.k})"

    def packing(self) -> tuple[str, tuple]:
        """(kind, stacked arrays): what ``ExpertMatrix(..., packed=...)`` takes back."""
        return self.kind, self._stack

    def matmul_id(self, x: np.ndarray, ids: np.ndarray, min_macs: int | None = None) -> np.ndarray:
        """ids i32 [n, n_used]; x f32 [n, k] (every slot of a token reads its row) or
        [n, n_used, k] (a row per slot) -> f32 [n, n_used, m]: out[t, s] = x[t(, s)] @ W[ids[t, s]].T.
        min_macs: the parallel threshold of QMatrix.matmul, on the launch's n * n_used * m * k
        multiply-adds (the same bits either way)."""
        n, n_used = ids.shape
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.n_expert):
            raise IndexError(f"matmul_id: expert id out of range 0..{self.n_expert - 1}")
        per_slot = x.ndim == 3
        xr = x.reshape(n * n_used, -1) if per_slot else x
        if self.fmt is None:
            return self._per_expert(xr, flat, n, n_used, per_slot, min_macs)
        if not (xr.dtype == np.float32 and xr.flags.c_contiguous):
            xr = np.ascontiguousarray(xr, dtype=np.float32)
        if xr.ndim != 2 or xr.shape[1] != self.k:
            raise ValueError(f"matmul_id: x has {xr.shape[-1]} columns, the experts have k={self.k}")
        n_pairs = n * n_used
        if n == 1:  # one token: its slots in order, a segment each (no grouping to do)
            zeros, slots, bounds = self._slots(n_used)
            src, seg_e, seg_p, order = (slots if per_slot else zeros), flat.astype(np.int64), bounds, None
        else:  # the pairs grouped by expert, in (t, s) order within one
            order = np.argsort(flat, kind="stable")
            counts = np.bincount(flat, minlength=self.n_expert)
            seg_e = np.flatnonzero(counts)
            seg_p = np.zeros(seg_e.size + 1, np.int64)
            np.cumsum(counts[seg_e], out=seg_p[1:])
            src = order if per_slot else order // n_used
        y = np.empty((n_pairs, self.m), np.float32)  # [P, m], the pairs in segment order
        if n_pairs:
            if n_pairs * self._macs_per_pair < (parallel.MATMUL_PAR_MIN_MACS if min_macs is None else min_macs):
                kernel, args = matmul_id_q_serial, self._args + (xr, src, seg_e, seg_p, y, TOKEN_CHUNK)
            else:
                kernel, args = matmul_id_q, self._args + (xr, src, seg_e, seg_p, y, TOKEN_CHUNK, _RUNS)
            call_compiled(self._entry, kernel, args)
        if order is not None:
            out = np.empty_like(y)
            out[order] = y
            y = out
        return y.reshape(n, n_used, self.m)

    def _slots(self, n_used: int) -> tuple:
        s = self._slot_index.get(n_used)
        if s is None:
            s = self._slot_index[n_used] = (
                np.zeros(n_used, np.int64),
                np.arange(n_used, dtype=np.int64),
                np.arange(n_used + 1, dtype=np.int64),
            )
        return s

    def _per_expert(self, xr, flat, n, n_used, per_slot, min_macs) -> np.ndarray:
        """Float experts: each expert's QMatrix once on its pairs' rows."""
        out = np.empty((n * n_used, self.m), np.float32)  # [(t, s), m]
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=self.n_expert)
        start = 0
        for e in np.flatnonzero(counts):
            pairs = order[start : start + counts[e]]
            start += counts[e]
            rows = xr[pairs] if per_slot else xr[pairs // n_used]  # [c, k] f32 (a gather: contiguous)
            out[pairs] = self.experts[e].matmul(rows, min_macs)
        return out.reshape(n, n_used, self.m)
