"""Rotary position embedding (RoPE), the two layouts llama.cpp knows.

"norm" (LLAMA_ROPE_TYPE_NORM) rotates adjacent pairs (x[2i], x[2i+1]); "neox" rotates
(x[i], x[i + n_rot/2]). Used by the forward pass on fresh Q/K and by the KV cache's K-shift,
which re-rotates cached keys by a position delta (rotation by a then by b == rotation by a+b).
"""
import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=True, parallel=True)
def rope_inplace(x, pos, n_rot, freq_base, freq_scale, neox):
    """Rotate x in place. x: [n_tokens, n_head, head_dim] f32; pos: [n_tokens] i32 (or a delta)."""
    n_tokens, n_head, head_dim = x.shape
    half = n_rot // 2
    # theta_i = p * freq_scale * base^(-2i/n_rot), computed per token in float64 like ggml's cache
    for t in prange(n_tokens):
        p = np.float64(pos[t]) * freq_scale
        for i in range(half):
            theta = p * freq_base ** (-2.0 * i / n_rot)
            c = np.float32(np.cos(theta))
            s = np.float32(np.sin(theta))
            for h in range(n_head):
                if neox:
                    a = x[t, h, i]
                    b = x[t, h, i + half]
                    x[t, h, i] = a * c - b * s
                    x[t, h, i + half] = a * s + b * c
                else:
                    a = x[t, h, 2 * i]
                    b = x[t, h, 2 * i + 1]
                    x[t, h, 2 * i] = a * c - b * s
                    x[t, h, 2 * i + 1] = a * s + b * c
