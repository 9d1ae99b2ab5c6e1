"""numba kernels of the KV cache: write fresh K/V rows into slot cells, build the KQ mask.

Kept apart from kv_cache.py (which is bookkeeping) so the hot loops read as kernels: flat
loops over explicit arrays, one launch per layer per ubatch whatever the token count.
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels.quants import quant_row_any


@njit(cache=True)
def scatter_rows(dst, x, strm, cell, t):
    """Quantize rows of x into cache cells. dst u8 [n_stream, kv_size, row_bytes];
    x f32 [n, n_embd]; strm, cell i64 [n]: row i goes to dst[strm[i], cell[i]] as type t."""
    for i in range(x.shape[0]):
        quant_row_any(t, x[i], dst[strm[i], cell[i]])


@njit(cache=True, parallel=True)
def scatter_rows_par(dst, x, strm, cell, t):
    """scatter_rows for large ubatches (rows in parallel; slot cells are distinct)."""
    for i in prange(x.shape[0]):
        quant_row_any(t, x[i], dst[strm[i], cell[i]])


@njit(cache=True)
def scatter_rows_trans(dst, x, strm, cell, t, el):
    """Write rows of x into a transposed V cache: value j of row i goes to element cell[i] of
    row j. dst u8 [n_stream, n_embd, kv_size * el]; x f32 [n, n_embd]; el = bytes/element."""
    n, k = x.shape
    tmp = np.empty(k * el, dtype=np.uint8)  # one converted row [n_embd * el] u8
    for i in range(n):
        quant_row_any(t, x[i], tmp)
        s = strm[i]
        o = cell[i] * el
        for j in range(k):
            for b in range(el):
                dst[s, j, o + b] = tmp[j * el + b]


@njit(cache=True)
def _mask_row(out, t, cell_pos, cell_seq, tok_pos, tok_seq, n_kv, n_swa):
    """One token's mask row: 0 where it may attend, -inf elsewhere."""
    neg_inf = np.float32(-np.inf)
    p1 = tok_pos[t]
    s = tok_seq[t]
    for j in range(n_kv):
        p0 = cell_pos[j]
        ok = p0 >= 0 and p0 <= p1 and cell_seq[j, s]
        if ok and n_swa > 0 and p1 - p0 >= n_swa:
            ok = False
        out[t, j] = np.float32(0.0) if ok else neg_inf


@njit(cache=True)
def build_kq_mask(out, rows, cell_pos, cell_seq, tok_pos, tok_seq, n_kv, n_swa):
    """Fill out[rows[r], :n_kv] with 0 (attend) or -inf for the tokens rows of one stream.

    out f32 [n_tokens, n_kv]; rows i64 [m] tokens of this stream; cell_pos i32 [kv_size]
    (-1 = empty); cell_seq bool [kv_size, n_seq_max]; tok_pos, tok_seq i32 [n_tokens].
    A cell is visible when it holds the token's sequence, is not in its future (causal) and,
    if n_swa > 0, is inside the sliding window (masked when p_tok - p_cell >= n_swa)."""
    for r in range(rows.shape[0]):
        _mask_row(out, rows[r], cell_pos, cell_seq, tok_pos, tok_seq, n_kv, n_swa)


@njit(cache=True, parallel=True)
def build_kq_mask_par(out, rows, cell_pos, cell_seq, tok_pos, tok_seq, n_kv, n_swa):
    """build_kq_mask with tokens in parallel (prefill-sized ubatches only: a parallel launch
    costs far more than a one-token mask)."""
    for r in prange(rows.shape[0]):
        _mask_row(out, rows[r], cell_pos, cell_seq, tok_pos, tok_seq, n_kv, n_swa)
