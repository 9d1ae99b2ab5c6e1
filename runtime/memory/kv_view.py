"""Position views of a unified KV cache: each sequence's attention sums independent of its neighbours.

The attention kernels (kernels/attention.py) sum a query's cells in tiles of KT and chunks of
CHUNK cells counted from a stream's cell 0, so the bits of a row depend on where its cells sit.
A sequence running alone sits at cell = position (or, in a sliding-window ring, at position
modulo the ring's size, a multiple of CHUNK, with the sums started at the oldest position it
sees), so its tiles and chunks are cut at multiples of KT and CHUNK of the *position*. In a
unified cache shared with other sequences its cells are interleaved with theirs, and the same
sums were cut elsewhere: answers changed in the last bits with the neighbours (issue #24).

A position view restores the solo order. For an ubatch whose sequences share one stream with
others (or sit anywhere but cell = position), `plan_view` lays each sequence of the ubatch out
as its own stream, row r holding the sequence's cell of position base + r (base a multiple of
CHUNK), a zero row where it has none (masked); `gather_k` / `gather_v` copy the layer's rows
into that layout after this ubatch's K/V are stored. Attention over the view runs the same
kernels with one stream per sequence, so each row's sums are cut at the positions a solo run
cuts them at, whatever else shares the cache and the batch.

A context made for one sequence never needs it (nothing else can be in its cache): no view,
no cost. Nor does a single sequence already laid out as a solo run lays it out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvchat.kernels.attention import CHUNK

NEG_INF = np.float32(-np.inf)


@dataclass
class PositionView:
    """idx i64 [n_view_streams, n_view]: cell of each (sequence, position - base), -1 for none;
    mask f32 [n_tokens, n_view] 0 / -inf; tok_stream i32 [n_tokens]: each token's view stream."""

    idx: np.ndarray
    mask: np.ndarray
    tok_stream: np.ndarray
    v_elem: int = 0  # bytes of one element of a transposed V (flash off)


def _solo_layout(cells, n_kv: int, kv_size: int, ring: bool) -> bool:
    """True if one sequence holds all cells of [0, n_kv) and sits as a solo run places it:
    cell - pos the same multiple of CHUNK for every cell (modulo the ring's size for a
    sliding-window ring, whose sums start at the oldest position), so the kernels already cut
    its sums at multiples of the position."""
    pos = cells.pos[:n_kv].astype(np.int64)
    used = pos >= 0
    if not used.any():
        return True
    seq = cells.seq[:n_kv][used]  # [n_used, n_seq_max]
    if int(seq.any(axis=0).sum()) > 1 or not seq.any(axis=1).all():
        return False
    d = np.flatnonzero(used).astype(np.int64) - pos[used]
    if ring:
        d %= kv_size
    return bool((d == d[0]).all() and d[0] % CHUNK == 0 and d[0] >= 0)


def plan_view(kv, n_kv: int, ub, mask: np.ndarray) -> PositionView | None:
    """The position view of this ubatch over cache kv's first n_kv cells, or None when the cells
    can be read as they are (a one-sequence context, several streams, or a solo layout).
    mask: the ubatch's cell mask f32 [n_tokens, n_kv] (kq_mask)."""
    if kv.n_seq_max <= 1 or kv.n_stream != 1 or n_kv == 0:
        return None
    cells = kv.cells[0]
    if _solo_layout(cells, n_kv, kv.kv_size, kv.n_swa > 0):
        return None
    seqs = sorted(set(ub.seq0.tolist()))
    pos = cells.pos[:n_kv].astype(np.int64)
    rows = []  # per view stream: (cells, positions - base)
    for s in seqs:
        js = np.flatnonzero(cells.seq[:n_kv, s] & (pos >= 0))
        p = pos[js]
        if js.size and np.unique(p).size != p.size:
            return None  # two cells of one position: no position layout (read the cells as they are)
        base = (int(p.min()) // CHUNK * CHUNK) if js.size else 0
        rows.append((js, p - base))
    n_view = max([int(r.max()) + 1 for _, r in rows if r.size] + [1])
    idx = np.full((len(seqs), n_view), -1, dtype=np.int64)  # [n_view_streams, n_view]
    for v, (js, r) in enumerate(rows):
        idx[v, r] = js
    vi = np.searchsorted(np.asarray(seqs, dtype=np.int64), ub.seq0.astype(np.int64))  # [n_tokens]
    g = idx[vi]  # [n_tokens, n_view] cell of each token's view row
    mask_v = np.where(g >= 0, np.take_along_axis(mask, np.maximum(g, 0), axis=1), NEG_INF).astype(np.float32)
    return PositionView(idx, np.ascontiguousarray(mask_v), vi.astype(np.int32), int(getattr(kv, "v_elem_bytes", 0)))


def gather_k(rows: np.ndarray, view: PositionView) -> np.ndarray:
    """u8 [1, n_kv, row_bytes] cache rows (K, or V with flash on) -> u8 [n_view_streams, n_view,
    row_bytes] in the view's layout; zero bytes (a zero row in every cache format) where a
    sequence has no cell."""
    idx = view.idx
    out = rows[0][np.maximum(idx, 0)]  # [n_view_streams, n_view, row_bytes]
    out[idx < 0] = 0
    return out


def gather_v_trans(v: np.ndarray, view: PositionView) -> np.ndarray:
    """Transposed V u8 [1, n_embd_v_gqa, kv_size * elem] -> u8 [n_view_streams, n_embd_v_gqa,
    n_view * elem] in the view's layout (zeros where a sequence has no cell)."""
    n_embd_v, elem = v.shape[1], view.v_elem
    v3 = v[0].reshape(n_embd_v, -1, elem)  # [n_embd_v_gqa, kv_size, elem]
    idx = view.idx
    out = v3[:, np.maximum(idx, 0), :]  # [n_embd_v_gqa, n_view_streams, n_view, elem]
    out[:, idx < 0, :] = 0
    return np.ascontiguousarray(out.transpose(1, 0, 2, 3)).reshape(idx.shape[0], n_embd_v, idx.shape[1] * elem)
