"""RMSNorm, as ggml_rms_norm followed by ggml_mul with the layer's weight.

y = x / sqrt(mean(x^2) + eps) * w. The sum of squares is accumulated in float64 as ggml does
(ggml_float), so long rows do not drift. Gemma's GGUF norm weights already hold (1 + w): the
converter adds the 1, so every architecture uses this one plain kernel.
QK-norm (qwen3, gemma3) is the same kernel applied to [n_tokens * n_head, head_dim] rows.

A parallel launch costs far more than normalizing a few rows (tens to hundreds of µs on a busy
machine), so small inputs — every generated token — run the serial twin of the kernel.
"""
import numpy as np
from numba import njit, prange

PARALLEL_MIN_ROWS = 16  # fewer rows than this: serial


@njit(cache=True, fastmath=True, inline="always")
def rms_norm_row(x, w, has_w, eps, out):
    """One row: x, out [d] f32 (out may alias x); w [d] f32 (ignored unless has_w)."""
    d = x.shape[0]
    acc = 0.0  # float64 accumulator, like ggml_float
    for i in range(d):
        v = np.float64(x[i])
        acc += v * v
    scale = np.float32(1.0 / np.sqrt(acc / d + eps))
    if has_w:
        for i in range(d):
            out[i] = x[i] * scale * w[i]
    else:
        for i in range(d):
            out[i] = x[i] * scale


@njit(cache=True, fastmath=True, parallel=True)
def _rms_norm_par(x, w, has_w, eps, out):
    """x, out: [n_rows, d] f32."""
    for r in prange(x.shape[0]):
        rms_norm_row(x[r], w, has_w, eps, out[r])


@njit(cache=True, fastmath=True)
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
    fn = _rms_norm_par if x2.shape[0] >= PARALLEL_MIN_ROWS else _rms_norm_ser
    if w is None:
        fn(x2, _NO_WEIGHT, False, np.float64(eps), o2)
    else:
        fn(x2, w, True, np.float64(eps), o2)
    return out
