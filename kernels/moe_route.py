"""Expert routing of a mixture-of-experts FFN: router logits -> (selected experts, their weights),
in the operation order of llama.cpp's build_moe_ffn (src/llama-graph.cpp) on ggml's CPU backend.

Per token (one row of logits, f32 [n_expert]):
1. gating: probs = softmax(logits) (ggml_soft_max: max, e = ggml's vector exp (this CPU's form of it) of x - max, sum
   in double of 8-wide f32 partial sums as ggml's AVX2 loop adds them, e * f32(1/sum)); or
   sigmoid (1 / (1 + expf(-x))); or, for gpt-oss (SOFTMAX_WEIGHT), the logits themselves;
2. selection: the k largest of probs (+ the expert-selection bias when given: DeepSeek-V3's
   exp_probs_b), largest first, equal values in index order — ggml_argsort_top_k is std::sort
   with a > b, which for up to 16 experts is an insertion sort and so keeps index order on ties;
3. weights = probs of the selected experts (unbiased); SOFTMAX_WEIGHT: their softmax; norm:
   divided by their sum (ggml_sum_rows: a double sum rounded to f32, clamped to >= 2^-14);
   scale: times w_scale when it is neither 0 nor 1.
Each row is computed alone in a fixed order, so a token's experts and weights do not depend on
the other tokens of the ubatch (batch invariance).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.ggml_math import expf_ggml

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 0, 1, 2  # llama_expert_gating_func_type order
GATING_NAMES = {"softmax": GATING_SOFTMAX, "sigmoid": GATING_SIGMOID, "softmax_weight": GATING_SOFTMAX_WEIGHT}
_MIN_SUM = np.float32(6.103515625e-5)  # build_moe_ffn's clamp of the weight sum (smallest normal f16)


@njit(cache=True, inline="always")
def _softmax_ggml(x, n, out):
    """out[:n] = ggml_soft_max of x[:n] (f32), as ggml_vec_soft_max_f32's AVX2 loop sums it."""
    mx = x[0]
    for j in range(1, n):
        if x[j] > mx:
            mx = x[j]
    s = 0.0  # ggml_float
    i = 0
    while i + 8 <= n:
        for j in range(8):
            out[i + j] = expf_ggml(np.float32(x[i + j] - mx))
        a0 = np.float32(out[i] + out[i + 4])  # extractf128 high + low
        a1 = np.float32(out[i + 1] + out[i + 5])
        a2 = np.float32(out[i + 2] + out[i + 6])
        a3 = np.float32(out[i + 3] + out[i + 7])
        b0 = np.float32(a0 + a2)  # movehl
        b1 = np.float32(a1 + a3)
        s += np.float32(b0 + b1)  # movehdup + add_ss
        i += 8
    while i < n:  # ggml's scalar tail: libm expf
        e = np.float32(math.exp(np.float32(x[i] - mx)))
        out[i] = e
        s += e
        i += 1
    inv = np.float32(1.0 / s)
    for j in range(n):
        out[j] = np.float32(out[j] * inv)


@njit(cache=True, inline="always")
def _route_row(logits, bias, has_bias, k, gating, norm, scale, probs, sel, ids, w):
    n = logits.shape[0]
    if gating == GATING_SOFTMAX:
        _softmax_ggml(logits, n, probs)
    elif gating == GATING_SIGMOID:
        for j in range(n):
            probs[j] = np.float32(np.float32(1.0) / np.float32(np.float32(1.0) + np.float32(math.exp(-logits[j]))))
    else:
        for j in range(n):
            probs[j] = logits[j]
    for j in range(n):
        sel[j] = np.float32(probs[j] + bias[j]) if has_bias else probs[j]
    for r in range(k):  # the r-th largest; ties: the lowest index first
        best = -1
        for j in range(n):
            if sel[j] == sel[j] and (best < 0 or sel[j] > sel[best]):  # NaN: already picked
                best = j
        if best < 0:  # only NaN left (a broken router): keep the slots valid expert ids
            best = r
        ids[r] = best
        w[r] = probs[best]
        sel[best] = np.nan  # never picked again
    if gating == GATING_SOFTMAX_WEIGHT:
        _softmax_ggml(w, k, probs)
        for r in range(k):
            w[r] = probs[r]
    if norm:
        s = 0.0
        for r in range(k):
            s += w[r]
        sf = np.float32(s)
        if sf < _MIN_SUM:
            sf = _MIN_SUM
        for r in range(k):
            w[r] = np.float32(w[r] / sf)
    if scale != np.float32(0.0) and scale != np.float32(1.0):
        for r in range(k):
            w[r] = np.float32(w[r] * scale)


@njit(cache=True, parallel=True)
def _route_par(logits, bias, has_bias, k, gating, norm, scale, ids, w):
    n_tok, n_exp = logits.shape
    for t in prange(n_tok):
        probs = np.empty(n_exp, np.float32)
        sel = np.empty(n_exp, np.float32)
        _route_row(logits[t], bias, has_bias, k, gating, norm, scale, probs, sel, ids[t], w[t])


@njit(cache=True)
def _route_ser(logits, bias, has_bias, k, gating, norm, scale, ids, w):
    """_route_par on this thread (a decoded token: ~1 µs of work, less than a parallel launch)."""
    n_tok, n_exp = logits.shape
    probs = np.empty(n_exp, np.float32)
    sel = np.empty(n_exp, np.float32)
    for t in range(n_tok):
        _route_row(logits[t], bias, has_bias, k, gating, norm, scale, probs, sel, ids[t], w[t])


def route_experts(
    logits: np.ndarray, k: int, gating: int, norm: bool, scale: float, bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """logits f32 [n, n_expert] -> (ids i32 [n, k] largest first, weights f32 [n, k]); see the module."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n, n_exp = logits.shape
    if not 0 < k <= n_exp:
        raise ValueError(f"route_experts: k={k} must be in 1..{n_exp}")
    # zeros, not empty: under the compile plan's dry run (kernels/compile_plan.py) the router kernel does not
    # run, and garbage ids would stop the planning decode at the first MoE layer (matmul_id's
    # range check), leaving every kernel after it out of the plan
    ids = np.zeros((n, k), np.int32)
    w = np.empty((n, k), np.float32)
    b = np.zeros(n_exp, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    if n:
        route = _route_par if n >= parallel.ROUTE_PAR_MIN_TOKENS else _route_ser
        route(logits, b, bias is not None, int(k), int(gating), bool(norm), np.float32(scale), ids, w)
    return ids, w
