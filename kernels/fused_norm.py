"""Residual adds fused with the RMSNorm that follows them: one launch where a layer made three.

Each block of a decoder ends by adding its output to the residual stream, and the next block
starts by normalizing that stream (the FFN after attention, the next layer's attention after
the FFN, the output norm after the last layer). For one generated token each of those steps is
a few hundred values — far less work than the Python call and numba dispatch around it — so the
forward passes run them as one kernel per seam:

    add_rms_norm:      x += a;                      h = rmsnorm(x) * w_next      (llama & co.)
    norm_add_rms_norm: a = rmsnorm(a) * w_post;  x += a;  h = rmsnorm(x) * w_next   (gemma's
                       post-attention / post-FFN norms)

The arithmetic is the unfused one, step for step: the add is one IEEE f32 add per element and
the norms are kernels/norm.py's rms_norm_row (ggml's in-order float64 sum), so results are
bit-identical to `x += a; rms_norm(x, w)` and every row depends on its own row only (batch
invariance; tests/test_fused_norm.py asserts both with array_equal). Serial twins below
parallel.RMS_NORM_PAR_MIN_ROWS rows, as kernels/norm.py.
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.norm import rms_norm_row


@njit(cache=True, inline="always")
def _add_norm_row(x, a, w, eps, h):
    """x [d] f32 += a [d] f32, then h [d] f32 = rmsnorm(x) * w."""
    for i in range(x.shape[0]):
        x[i] = x[i] + a[i]
    rms_norm_row(x, w, True, eps, h)


@njit(cache=True)
def _add_rms_norm_ser(x, a, w, eps, h):
    """x, a, h: [n, d] f32; w [d] f32."""
    for r in range(x.shape[0]):
        _add_norm_row(x[r], a[r], w, eps, h[r])


@njit(cache=True, parallel=True)
def _add_rms_norm_par(x, a, w, eps, h):
    for r in prange(x.shape[0]):
        _add_norm_row(x[r], a[r], w, eps, h[r])


@njit(cache=True)
def _norm_add_rms_norm_ser(a, w_post, x, w_next, eps, h):
    """a, x, h: [n, d] f32; w_post, w_next [d] f32."""
    for r in range(x.shape[0]):
        rms_norm_row(a[r], w_post, True, eps, a[r])
        _add_norm_row(x[r], a[r], w_next, eps, h[r])


@njit(cache=True, parallel=True)
def _norm_add_rms_norm_par(a, w_post, x, w_next, eps, h):
    for r in prange(x.shape[0]):
        rms_norm_row(a[r], w_post, True, eps, a[r])
        _add_norm_row(x[r], a[r], w_next, eps, h[r])


def _rows(x: np.ndarray) -> np.ndarray:
    if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"fused norm: rows must be C-contiguous f32 [n, d], got {x.dtype} {x.shape}")
    return x


def add_rms_norm(x: np.ndarray, a: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [n, d] f32 += a [n, d] (in place); returns h = rmsnorm(x) * w, a new [n, d] f32.
    (eps reaches the kernel as float64 whether given as a Python float or np.float64.)"""
    if not (x.ndim == 2 and x.dtype == np.float32 and x.flags.c_contiguous):
        _rows(x)
    if not (a.dtype == np.float32 and a.flags.c_contiguous):
        a = np.ascontiguousarray(a, dtype=np.float32)
    h = np.empty(x.shape, np.float32)
    fn = _add_rms_norm_par if x.shape[0] >= parallel.RMS_NORM_PAR_MIN_ROWS else _add_rms_norm_ser
    fn(x, a, w, float(eps), h)
    return h


def norm_add_rms_norm(a: np.ndarray, w_post: np.ndarray, x: np.ndarray, w_next: np.ndarray, eps: float) -> np.ndarray:
    """a [n, d] f32 = rmsnorm(a) * w_post (in place), x [n, d] += a (in place); returns
    h = rmsnorm(x) * w_next, a new [n, d] f32."""
    if not (x.ndim == 2 and x.dtype == np.float32 and x.flags.c_contiguous):
        _rows(x)
    if not (a.ndim == 2 and a.dtype == np.float32 and a.flags.c_contiguous):
        _rows(a)
    h = np.empty(x.shape, np.float32)
    fn = _norm_add_rms_norm_par if x.shape[0] >= parallel.RMS_NORM_PAR_MIN_ROWS else _norm_add_rms_norm_ser
    fn(a, w_post, x, w_next, float(eps), h)
    return h
