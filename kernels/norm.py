"""RMSNorm, as ggml_rms_norm followed by ggml_mul with the layer's weight.

y = x / sqrt(mean(x^2) + eps) * w. The sum of squares is accumulated in float64 as ggml does
(ggml_float), so long rows do not drift. Gemma's GGUF norm weights already hold (1 + w): the
converter adds the 1, so every architecture uses this one plain kernel.
QK-norm (qwen3, gemma3) is the same kernel applied to [n_tokens * n_head, head_dim] rows.
"""
import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=True, parallel=True)
def _rms_norm_rows(x, w, has_w, eps, out):
    """x, out: [n_rows, d] f32 (out may be x); w: [d] f32 (ignored unless has_w)."""
    n_rows, d = x.shape
    for r in prange(n_rows):
        acc = 0.0  # float64 accumulator, like ggml_float
        for i in range(d):
            v = np.float64(x[r, i])
            acc += v * v
        scale = np.float32(1.0 / np.sqrt(acc / d + eps))
        if has_w:
            for i in range(d):
                out[r, i] = x[r, i] * scale * w[i]
        else:
            for i in range(d):
                out[r, i] = x[r, i] * scale


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
    if w is None:
        _rms_norm_rows(x2, _NO_WEIGHT, False, np.float64(eps), o2)
    else:
        _rms_norm_rows(x2, w, True, np.float64(eps), o2)
    return out
