"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention), token by token.

Per sequence and value head h (q/k head h % H_k), with M the state [S_v, S_k] (M[j, i]: value
component j, key component i - ggml's state tensor ne {S_k, S_v, H_v} read row-major), q and k
L2-normalised, q scaled by 1/sqrt(S_k), g_t <= 0 the log decay and b_t in (0, 1):
    M    <- exp(g_t) M
    u_t  =  b_t (v_t - M k_t)                       (the delta: what M mispredicts for k_t)
    M    <- M + u_t k_t^T
    o_t  =  M q_t
accumulated in f64, the state rounded to f32 after every token as storing it between decodes
does: one batch, any ubatch size and token by token give the same bits. ggml's chunked form
(build_delta_net_chunking: C x C products per 64-token chunk) rounds the state at chunk ends
instead, so a prompt in one batch would differ from it token by token, and on this CPU its
products do not pay off (docs/performance.md); it is not used.
"""

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def delta_step(q, k, v, g, b, state, o, scale):
    """q, k f32 [n_seqs, n_t, H_k, S_k]; v f32 [n_seqs, n_t, H_v, S_v]; g, b f32 [n_seqs, n_t,
    H_v]; state f32 [n_seqs, H_v, S_v, S_k] updated in place; o f32 [n_seqs, n_t, H_v, S_v]."""
    n_seqs, n_t, h_k, s_k = q.shape
    h_v, s_v = v.shape[2], v.shape[3]
    for job in prange(n_seqs * h_v):
        s = job // h_v
        h = job % h_v
        hk = h % h_k
        m = state[s, h].astype(np.float64)  # [S_v, S_k]
        for t in range(n_t):
            decay = math.exp(g[s, t, h])
            beta = np.float64(b[s, t, h])
            for j in range(s_v):
                acc = 0.0
                for i in range(s_k):
                    m[j, i] *= decay
                    acc += m[j, i] * k[s, t, hk, i]
                u = beta * (v[s, t, h, j] - acc)
                acc_o = 0.0
                for i in range(s_k):
                    m[j, i] += u * k[s, t, hk, i]
                    acc_o += m[j, i] * q[s, t, hk, i]
                o[s, t, h, j] = acc_o * scale
            for j in range(s_v):  # the state is stored in f32 after every token
                for i in range(s_k):
                    m[j, i] = np.float32(m[j, i])
        for j in range(s_v):
            for i in range(s_k):
                state[s, h, j, i] = m[j, i]


def gated_delta_rule(q, k, v, g, b, state):
    """o f32 [n_seqs, n_t, H_v, S_v]; `state` f32 [n_seqs, H_v, S_v, S_k] is updated in place.
    q must already be L2-normalised; the 1/sqrt(S_k) query scale is applied here."""
    f = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    q, k, v, g, b = f(q), f(k), f(v), f(g), f(b)
    o = np.empty(v.shape, dtype=np.float32)
    delta_step(q, k, v, g, b, state, o, 1.0 / math.sqrt(q.shape[3]))
    return o
