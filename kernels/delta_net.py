"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention), one-token step and chunked.

Per sequence and value head h (q/k head h % H_k), with M the state [S_v, S_k] (M[j, i]: value
component j, key component i - ggml's state tensor ne {S_k, S_v, H_v} read row-major), q and k
L2-normalised, q scaled by 1/sqrt(S_k), g_t <= 0 the log decay and b_t in (0, 1):
    M    <- exp(g_t) M
    u_t  =  b_t (v_t - M k_t)                       (the delta: what M mispredicts for k_t)
    M    <- M + u_t k_t^T
    o_t  =  M q_t
`delta_step` runs this token by token. `delta_chunked` processes C tokens at once: with
G_t = g_1 + .. + g_t inside the chunk and M0 the state before it,
    u_t = b_t (v_t - e^{G_t} M0 k_t - sum_{s<t} e^{G_t - G_s} (k_s . k_t) u_s)    (triangular solve)
    o_t = e^{G_t} M0 q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) u_s
    M_C = e^{G_C} M0 + sum_s e^{G_C - G_s} u_s k_s^T
which is the same recurrence with the per-token rank-1 updates of M replaced by C x C products
(ggml's build_delta_net_chunking computes this form with 64-token chunks). Both accumulate in
f64 and round the state to f32 where it is stored, so the two agree to ~1e-7 relative; each is
deterministic per token and per chunk layout.
"""
import math

import numpy as np
from numba import njit, prange

CHUNK = 64  # tokens per chunk (llama.cpp's chunk size for the scalar-gate rule)


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


@njit(cache=True, parallel=True)
def delta_chunked(q, k, v, g, b, state, o, scale, chunk):
    """Same arguments and result as delta_step, computed chunk by chunk (see module doc)."""
    n_seqs, n_t, h_k, s_k = q.shape
    h_v, s_v = v.shape[2], v.shape[3]
    for job in prange(n_seqs * h_v):
        s = job // h_v
        h = job % h_v
        hk = h % h_k
        m = state[s, h].astype(np.float64)  # [S_v, S_k]
        u = np.empty((chunk, s_v), dtype=np.float64)
        G = np.empty(chunk, dtype=np.float64)
        kk = np.empty((chunk, chunk), dtype=np.float64)  # k_r . k_t (r < t)
        kq = np.empty((chunk, chunk), dtype=np.float64)  # k_r . q_t (r <= t)
        for c0 in range(0, n_t, chunk):
            c = min(chunk, n_t - c0)
            acc_g = 0.0
            for t in range(c):
                acc_g += g[s, c0 + t, h]
                G[t] = acc_g
            for t in range(c):
                for r in range(t + 1):
                    acc_k = 0.0
                    acc_q = 0.0
                    for i in range(s_k):
                        kr = np.float64(k[s, c0 + r, hk, i])
                        acc_k += kr * k[s, c0 + t, hk, i]
                        acc_q += kr * q[s, c0 + t, hk, i]
                    kk[t, r] = acc_k
                    kq[t, r] = acc_q
            for t in range(c):  # forward substitution for u_t
                beta = np.float64(b[s, c0 + t, h])
                eg = math.exp(G[t])
                for j in range(s_v):
                    acc = 0.0
                    for i in range(s_k):
                        acc += m[j, i] * k[s, c0 + t, hk, i]
                    w = v[s, c0 + t, h, j] - eg * acc
                    for r in range(t):
                        w -= math.exp(G[t] - G[r]) * kk[t, r] * u[r, j]
                    u[t, j] = beta * w
            for t in range(c):  # outputs
                eg = math.exp(G[t])
                for j in range(s_v):
                    acc = 0.0
                    for i in range(s_k):
                        acc += m[j, i] * q[s, c0 + t, hk, i]
                    acc *= eg
                    for r in range(t + 1):
                        acc += math.exp(G[t] - G[r]) * kq[t, r] * u[r, j]
                    o[s, c0 + t, h, j] = acc * scale
            eg_last = math.exp(G[c - 1])  # the state after the chunk
            for j in range(s_v):
                for i in range(s_k):
                    acc = eg_last * m[j, i]
                    for r in range(c):
                        acc += math.exp(G[c - 1] - G[r]) * u[r, j] * k[s, c0 + r, hk, i]
                    m[j, i] = np.float32(acc)
        for j in range(s_v):
            for i in range(s_k):
                state[s, h, j, i] = m[j, i]


def gated_delta_rule(q, k, v, g, b, state, chunked: bool):
    """o f32 [n_seqs, n_t, H_v, S_v]; `state` f32 [n_seqs, H_v, S_v, S_k] is updated in place.
    q must already be L2-normalised; the 1/sqrt(S_k) query scale is applied here."""
    f = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    q, k, v, g, b = f(q), f(k), f(v), f(g), f(b)
    o = np.empty(v.shape, dtype=np.float32)
    scale = 1.0 / math.sqrt(q.shape[3])
    if chunked:
        delta_chunked(q, k, v, g, b, state, o, scale, CHUNK)
    else:
        delta_step(q, k, v, g, b, state, o, scale)
    return o
