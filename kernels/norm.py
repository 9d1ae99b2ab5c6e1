"""RMSNorm, as ggml_rms_norm followed by ggml_mul with the layer's weight.

y = x / sqrt(mean(x^2) + eps) * w in ggml's operation order (ops.cpp rms_norm_f32): the f32
squares summed in float64 in element order (ggml_float), the mean and the scale in f32, so a
row's bits equal llama.cpp's. Gemma's GGUF norm weights already hold (1 + w): the
converter adds the 1, so every architecture uses this one plain kernel.
QK-norm (qwen3, gemma3) is the same kernel applied to [n_tokens * n_head, head_dim] rows.

A parallel launch costs far more than normalizing a few rows (tens to hundreds of µs on a busy
machine), so small inputs — every generated token — run the serial twin of the kernel.
Batch invariance (kernels/attention.py): a row's result must not depend on which twin runs, on
the other rows, or on how numba happened to compile or cache a helper. So there is no fast-math:
the sum of squares is one running sum in element order (a fast-math reduction lets LLVM choose
the order per loop nest), the scaling is plain IEEE arithmetic. It costs about 1.5 µs per
576-value row, next to milliseconds of matmul per token.
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel


@njit(cache=True)
def sum_sq_f64(x):
    """Sum of x[i]^2 over a row x [d] f32 as ggml's rms_norm sums it: each square rounded to f32,
    widened to float64 and added in element order (one running sum)."""
    s = 0.0
    for i in range(x.shape[0]):
        s += np.float64(x[i] * x[i])
    return s


@njit(cache=True, inline="always")
def rms_norm_row(x, w, has_w, eps, out):
    """One row: x, out [d] f32 (out may alias x); w [d] f32 (ignored unless has_w).
    ggml's arithmetic: mean = f32(sum / d), scale = 1 / sqrtf(mean + eps) in f32 (eps as its
    f32 op parameter), y = (x * scale) * w."""
    d = x.shape[0]
    mean = np.float32(sum_sq_f64(x) / d)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    if has_w:
        for i in range(d):
            out[i] = x[i] * scale * w[i]
    else:
        for i in range(d):
            out[i] = x[i] * scale


@njit(cache=True, parallel=True)
def _rms_norm_par(x, w, has_w, eps, out):
    """x, out: [n_rows, d] f32."""
    for r in prange(x.shape[0]):
        rms_norm_row(x[r], w, has_w, eps, out[r])


@njit(cache=True)
def _rms_norm_ser(x, w, has_w, eps, out):
    for r in range(x.shape[0]):
        rms_norm_row(x[r], w, has_w, eps, out[r])


_NO_WEIGHT = np.ones(1, dtype=np.float32)


def rms_norm(x, w, eps, out=None):
    """RMS-normalize the rows of x ([..., d] f32, C-contiguous) and scale by w ([d] f32 or None).

    Returns out (a new array unless given; out=x normalizes in place), same shape as x.
    """
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # [n_rows, d] f32 view
    if out is None:
        out = np.empty_like(x)
    o2 = out.reshape(-1, d)
    fn = _rms_norm_par if x2.shape[0] >= parallel.RMS_NORM_PAR_MIN_ROWS else _rms_norm_ser
    if w is None:
        fn(x2, _NO_WEIGHT, False, np.float64(eps), o2)
    else:
        fn(x2, w, True, np.float64(eps), o2)
    return out
