"""q4_0 rounding that minimizes an importance-weighted error (a self-draft's copy of its target).

ggml's reference q4_0 (quants_legacy.quant_row_q4_0) takes the scale from a block's largest
value: simple, and what a file written by llama-quantize without an imatrix holds. A model that
drafts for itself (runtime/speculative/self_quant.py) makes its copy at load and only wants to
agree with its target as often as possible, so it may round better: per 32-value block, try 19
scales around the max-abs one, give each its least-squares d (rounded to f16, as stored) and
keep the one with the least sum over the block of w_j (x_j - d q_j)^2, where w_j is the input
column's importance (the mean square of the activations the matrix met on a calibration text,
runtime/speculative/importance.py) times sqrt(sigma^2 + x_j^2), as llama.cpp's imatrix q4_0
weighs it. The layout is q4_0's: every q4_0 kernel reads the result.
"""

import numpy as np
from numba import njit, prange

from .quants_fp import f16_to_f32, f32_to_f16, write_f16

QK = 32
N_STEPS = 9  # scales -(8 + 0.1 i) / max for i in -N_STEPS..N_STEPS


@njit(cache=True)
def _f16_round(d):
    """d (f32) rounded to the nearest f16, back in f32: the scale as a q4_0 block stores it."""
    return f16_to_f32(f32_to_f16(d))


@njit(cache=True, fastmath=True)
def _block(x, w, b, dst):
    """Block b of row x (f32 [k]) with weights w (f32 [k]) -> 18 bytes of dst (u8 [k/32 * 18])."""
    o = b * 18
    x0 = b * QK
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(QK):
        a = abs(x[x0 + j])
        if a > amax:
            amax, mx = a, x[x0 + j]
    best_d = np.float32(0.0)
    best_s = np.float32(0.0)  # the chosen candidate's inverse scale
    if amax > 0.0:
        sxx = np.float32(0.0)
        for j in range(QK):
            sxx += w[x0 + j] * x[x0 + j] * x[x0 + j]
        best_err = np.float32(np.inf)
        for i in range(-N_STEPS, N_STEPS + 1):
            iscale = np.float32(-(8.0 + 0.1 * i)) / mx
            sumlx = np.float32(0.0)
            suml2 = np.float32(0.0)
            for j in range(QK):
                q = min(np.float32(7.0), max(np.float32(-8.0), np.rint(x[x0 + j] * iscale)))
                sumlx += w[x0 + j] * x[x0 + j] * q
                suml2 += w[x0 + j] * q * q
            if suml2 <= 0.0:
                continue
            d = _f16_round(sumlx / suml2)
            err = sxx - np.float32(2.0) * d * sumlx + d * d * suml2  # sum of w (x - d q)^2
            if err < best_err:
                best_err, best_d, best_s = err, d, iscale
    write_f16(dst, o, best_d)
    for j in range(16):
        q0 = 8 + np.int64(min(7.0, max(-8.0, np.rint(x[x0 + j] * best_s))))
        q1 = 8 + np.int64(min(7.0, max(-8.0, np.rint(x[x0 + j + 16] * best_s))))
        dst[o + 2 + j] = np.uint8(q0 | (q1 << 4))


@njit(cache=True, parallel=True)
def _rows(x, importance, out):
    n, k = x.shape  # x f32 [n, k], importance f32 [k], out u8 [n, k/32 * 18]
    for r in prange(n):
        row = x[r]
        sigma2 = np.float32(0.0)
        for j in range(k):
            sigma2 += row[j] * row[j]
        sigma2 /= np.float32(k)
        w = np.empty(k, np.float32)
        for j in range(k):
            w[j] = importance[j] * np.sqrt(sigma2 + row[j] * row[j])
        for b in range(k // QK):
            _block(row, w, b, out[r])


def quantize_q4_0_weighted(x: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """x f32 [n, k] (k a multiple of 32), importance f32 [k] (>= 0; ones for none) -> q4_0 rows
    u8 [n, k/32 * 18] rounded to the least importance-weighted error (module docstring)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    if k % QK:
        raise ValueError(f"quantize_q4_0_weighted: {k} columns is not a whole number of 32-value blocks")
    importance = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if importance.shape[0] != k:
        raise ValueError(f"quantize_q4_0_weighted: {importance.shape[0]} importances for {k} columns")
    out = np.empty((n, k // QK * 18), np.uint8)  # [n, row_bytes]
    _rows(x, importance, out)
    return out
