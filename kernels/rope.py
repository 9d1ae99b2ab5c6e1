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
    # ggml's rope cache: theta_0 = p, theta_{i+1} = theta_i * base^(-2/n_rot), all in float32,
    # then theta * freq_scale per pair (no YaRN ramp: ext_factor 0, attn_factor 1).
    theta_scale = np.float32(np.float64(freq_base) ** (-2.0 / n_rot))
    fs = np.float32(freq_scale)
    for t in prange(n_tokens):
        cs = np.empty((half, 2), dtype=np.float32)  # [half, (cos, sin)] f32
        theta = np.float32(pos[t])
        for i in range(half):
            th = fs * theta
            cs[i, 0] = np.float32(np.cos(th))
            cs[i, 1] = np.float32(np.sin(th))
            theta = np.float32(theta * theta_scale)
        for h in range(n_head):
            for i in range(half):
                c = cs[i, 0]
                s = cs[i, 1]
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
