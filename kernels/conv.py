"""Causal depthwise conv with a rolling state (ggml_ssm_conv, as Mamba / LFM2 / Qwen3.5 use it).

Per sequence, channel c and token t of a ubatch:
    y[t, c] = sum_{i < d_conv} xx[t + i, c] * w[c, i]      xx = concat(state[c, :], x[:, c])
where the state holds the last d_conv - 1 inputs of the sequence before this ubatch. The new
state is the last d_conv - 1 columns of xx. ggml sums in f32 in the order i = 0 .. d_conv - 1
(not in double), and so do we: a token's output depends only on its own window, computed the
same way however the sequence is split into ubatches (bit-identical).
"""

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def ssm_conv(state, x, w, y, new_state):
    """state f32 [n_seqs, ch, d_conv - 1]: inputs before the ubatch (ggml's conv state layout);
    x f32 [n_seqs, n_t, ch]; w f32 [ch, d_conv]; outputs y f32 [n_seqs, n_t, ch] and
    new_state f32 [n_seqs, ch, d_conv - 1] (may not alias state)."""
    n_seqs, n_t, ch = x.shape
    dc = w.shape[1]
    dc1 = dc - 1
    for c in prange(ch):
        for s in range(n_seqs):
            for t in range(n_t):
                acc = np.float32(0.0)
                for i in range(dc):
                    j = t + i  # index into xx = [state (dc1) | x (n_t)]
                    v = state[s, c, j] if j < dc1 else x[s, j - dc1, c]
                    acc += v * w[c, i]
                y[s, t, c] = acc
            for i in range(dc1):
                j = n_t + i  # the last dc1 entries of xx
                new_state[s, c, i] = state[s, c, j] if j < dc1 else x[s, j - dc1, c]


def conv_with_state(state: np.ndarray, x: np.ndarray, w: np.ndarray):
    """(y f32 [n_seqs, n_t, ch], new_state f32 [n_seqs, ch, d_conv - 1]) of ssm_conv."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    state = np.ascontiguousarray(state, dtype=np.float32)
    y = np.empty_like(x)
    new_state = np.empty_like(state)
    ssm_conv(state, x, np.ascontiguousarray(w, dtype=np.float32), y, new_state)
    return y, new_state
