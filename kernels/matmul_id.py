"""ggml_mul_mat_id on CPU: a stack of expert matrices, each token multiplied by its chosen ones.

A mixture-of-experts FFN stores each projection of all experts as one 3-D tensor, ggml ne
[k, m, n_expert] (`ffn_{gate,up,down}_exps`): expert e's matrix is rows e*m .. (e+1)*m - 1 of
the file's [n_expert * m, row_bytes] view. ``ExpertMatrix`` keeps one ``QMatrix`` per expert on
those rows (repacked in their own block format, never dequantized; several parts with one
format and row length, e.g. gate and up, are stacked per expert into one matrix so they run as
one matmul). ``matmul_id(x, ids)`` groups the (token, slot) pairs of a ubatch by expert and
runs each expert's matrix once on its rows: an expert's weights are read once per ubatch, and a
decoded token reads only its k experts. QMatrix.matmul computes each row from that row of x
alone, and the pairs only gather and scatter rows, so a token's result is bit-identical
whatever else is in the ubatch (batch invariance).
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix, release_file_pages


class ExpertMatrix:
    """n_expert matrices of m rows by k values (ggml type t), one QMatrix each.

    parts: the raw u8 [n_expert * m_i, row_bytes] views of the stacked tensors whose rows are
    concatenated per expert (one part, or gate and up); packed: per expert, the packing
    ``packings()`` returned (a weight-cache hit: the rows are not read)."""

    def __init__(self, parts: list, t: int, k: int, n_expert: int, *, packed: list | None = None, ms=None):
        self.t, self.k, self.n_expert = int(t), int(k), int(n_expert)
        self.ms = tuple(int(m) for m in ms) if ms is not None else tuple(p.shape[0] // n_expert for p in parts)
        self.m = sum(self.ms)
        self.experts: list[QMatrix] = []
        for e in range(self.n_expert):
            if packed is not None:
                self.experts.append(QMatrix(None, t, k, keep_raw=False, packed=packed[e], m=self.m))
                continue
            rows = [p[e * m : (e + 1) * m] for p, m in zip(parts, self.ms)]
            raw = rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)  # [m, row_bytes] u8
            self.experts.append(QMatrix(raw, t, k, keep_raw=False))
            for r in rows:
                release_file_pages(r)
        self.nbytes = sum(q.nbytes for q in self.experts)  # bytes in the file
        self.expert_nbytes = self.nbytes // max(self.n_expert, 1)  # what one routed token reads of it

    def __repr__(self) -> str:
        return f"ExpertMatrix({GGMLType(self.t).name}, n_expert={self.n_expert}, m={self.m}, k={self.k})"

    def packings(self) -> list:
        return [q.packing() for q in self.experts]

    def matmul_id(self, x: np.ndarray, ids: np.ndarray, min_macs: int | None = None) -> np.ndarray:
        """ids i32 [n, n_used]; x f32 [n, k] (every slot of a token reads its row) or
        [n, n_used, k] (a row per slot) -> f32 [n, n_used, m]: out[t, s] = x[t(, s)] @ W[ids[t, s]].T.
        min_macs: QMatrix.matmul's parallel threshold (the same bits either way)."""
        n, n_used = ids.shape
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.n_expert):
            raise IndexError(f"matmul_id: expert id out of range 0..{self.n_expert - 1}")
        per_slot = x.ndim == 3
        xr = x.reshape(n * n_used, -1) if per_slot else x
        out = np.empty((n * n_used, self.m), np.float32)  # [(t, s), m]
        if n == 1 and not per_slot:  # one decoded token: its k experts, no grouping to do
            for s in range(n_used):
                out[s] = self.experts[flat[s]].matmul(xr, min_macs)[0]
            return out.reshape(n, n_used, self.m)
        order = np.argsort(flat, kind="stable")  # pairs grouped by expert, in (t, s) order within one
        counts = np.bincount(flat, minlength=self.n_expert)
        start = 0
        for e in np.flatnonzero(counts):
            pairs = order[start : start + counts[e]]
            start += counts[e]
            rows = xr[pairs] if per_slot else xr[pairs // n_used]  # [c, k] f32 (a gather: contiguous)
            out[pairs] = self.experts[e].matmul(rows, min_macs)
        return out.reshape(n, n_used, self.m)
