"""Mamba-1 selective scan (ggml_ssm_scan with a per-element decay A [d_inner, d_state]).

Per sequence, channel d and token t (dt before softplus, A = -exp(A_log) as stored in GGUF):
    dt'  = softplus(dt[t, d])                      (x if x > 20 else log1p(e^x), as ggml)
    h[d, n] = h[d, n] * exp(dt' * A[d, n]) + B[t, n] * (x[t, d] * dt')
    y[t, d] = sum_n h[d, n] * C[t, n]              (f32, n in order)
The scan is sequential in t with f32 arithmetic in ggml's order, so a token's output and the
final state are the same bits whether the tokens came in one ubatch or several.
"""

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def softplus_f32(x):
    """ggml_compute_softplus_f32: x above 20, else log1p(exp(x)), in f32."""
    if x > np.float32(20.0):
        return x
    return np.float32(math.log1p(np.float32(math.exp(x))))


@njit(cache=True, parallel=True)
def selective_scan(s0, x, dt, A, B, C, y, s_out):
    """s0 f32 [n_seqs, d_inner, d_state] (initial states); x, dt f32 [n_seqs, n_t, d_inner];
    A f32 [d_inner, d_state]; B, C f32 [n_seqs, n_t, d_state]; outputs y f32 [n_seqs, n_t,
    d_inner] and s_out f32 [n_seqs, d_inner, d_state] (may alias s0)."""
    n_seqs, n_t, d_inner = x.shape
    d_state = A.shape[1]
    for d in prange(d_inner):
        h = np.empty(d_state, dtype=np.float32)
        for s in range(n_seqs):
            for n in range(d_state):
                h[n] = s0[s, d, n]
            for t in range(n_t):
                dts = softplus_f32(dt[s, t, d])
                x_dt = x[s, t, d] * dts
                acc = np.float32(0.0)
                for n in range(d_state):
                    st = h[n] * np.float32(math.exp(dts * A[d, n])) + B[s, t, n] * x_dt
                    acc += st * C[s, t, n]
                    h[n] = st
                y[s, t, d] = acc
            for n in range(d_state):
                s_out[s, d, n] = h[n]


def scan(s0, x, dt, A, B, C):
    """(y f32 [n_seqs, n_t, d_inner], final states f32 [n_seqs, d_inner, d_state])."""
    f = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    x = f(x)
    y = np.empty_like(x)
    s_out = np.empty((x.shape[0], x.shape[2], A.shape[1]), dtype=np.float32)
    selective_scan(f(s0), x, f(dt), f(A), f(B), f(C), y, s_out)
    return y, s_out
