"""Row kernels over output logits: NLL, llama-perplexity's 16-bit log-prob rows, KL divergence.

The arithmetic follows tools/perplexity/perplexity.cpp step by step (float32 values, a float64
sum of float32 exponentials, the 16-nat floor of the stored range, first index on ties), so a
base file we write holds the same bytes llama-perplexity would write for the same logits, and
statistics we compute from a base file are the ones it would print.

Stored row (uint16 [nv], nv = 2 * ceil(n_vocab / 2) + 4): words 0-1 = float32 scale, words 2-3 =
float32 min_log_prob, then per token q = round((logit - min_logit) / scale) with
min_logit = max(min logit, max logit - 16); log p = scale * q + min_log_prob.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F0 = np.float32(0.0)
F16 = np.float32(16.0)
FM16 = np.float32(-16.0)
F65535 = np.float32(65535.0)
F1 = np.float32(1.0)
ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds a float to an integer


def row_words(n_vocab: int) -> int:
    """uint16 words per stored row: the 4-word header plus n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


@njit(cache=True, inline="always")
def _max_sum_exp(x):
    """(max, index of the first max, float64 sum of expf(x - max)) of f32 x [n]."""
    n = x.shape[0]
    m = x[0]
    im = 0
    for i in range(1, n):
        if x[i] > m:
            m = x[i]
            im = i
    s = 0.0
    for i in range(n):
        s += np.exp(x[i] - m)
    return m, im, s


@njit(cache=True, parallel=True)
def nll_rows(logits, targets, out):
    """out f64 [n] = -log softmax(logits[i])[targets[i]]; logits f32 [n, n_vocab], targets i64 [n]."""
    for r in prange(logits.shape[0]):
        x = logits[r]
        m, _, s = _max_sum_exp(x)
        lse = np.float32(np.log(s))
        out[r] = np.float64(m + lse - x[targets[r]])


@njit(cache=True, parallel=True)
def quantize_log_prob_rows(logits, targets, rows, nll):
    """llama-perplexity's base-file rows. logits f32 [n, n_vocab]; rows u16 [n, nv] (written);
    targets i64 [n]; nll f64 [n] (written, the row's -log p of its target)."""
    n_vocab = logits.shape[1]
    for r in prange(logits.shape[0]):
        x = logits[r]
        m, _, s = _max_sum_exp(x)
        lo = x[0]
        for i in range(1, n_vocab):
            if x[i] < lo:
                lo = x[i]
        if lo < m - F16:
            lo = m - F16
        lse = np.float32(np.log(s))
        min_log_prob = lo - m - lse
        scale = (m - lo) / F65535
        head = rows[r, 0:4].view(np.float32)
        head[0] = scale
        head[1] = min_log_prob
        q = rows[r, 4:]
        if scale != F0:
            inv = F1 / scale
            for i in range(n_vocab):
                if x[i] > lo:
                    v = inv * (x[i] - lo) + ROUND_MAGIC  # float32: rounds half to even
                    q[i] = np.uint16(np.int64(v - ROUND_MAGIC))
                else:
                    q[i] = 0
        else:
            for i in range(n_vocab):
                q[i] = 0
        for i in range(n_vocab, q.shape[0]):
            q[i] = 0
        nll[r] = np.float64(m + lse - x[targets[r]])


@njit(cache=True, parallel=True)
def kld_rows(logits, base, targets, out):
    """Per row, against a stored base row: out f64 [n, 5] = (nll, nll_base, KL(base || Q),
    p - p_base of the target, 1.0 if both argmaxes agree). logits f32 [n, n_vocab];
    base u16 [n, nv]; targets i64 [n]."""
    n_vocab = logits.shape[1]
    for r in prange(logits.shape[0]):
        x = logits[r]
        m, imax, s = _max_sum_exp(x)
        lse = np.float32(np.log(s))
        head = base[r, 0:4].view(np.float32)
        scale = head[0]
        min_lp = head[1]
        q = base[r, 4:]
        tok = targets[r]
        nll = m + lse - x[tok]
        nll_base = -(scale * np.float32(q[tok]) + min_lp)
        mm = m + lse
        acc = 0.0
        imax_base = 0
        lp_max = F0
        for i in range(n_vocab):
            lp = scale * np.float32(q[i]) + min_lp
            if i == 0 or lp > lp_max:
                lp_max = lp
                imax_base = i
            if lp > FM16:
                acc += np.exp(lp) * (lp - x[i] + mm)
        out[r, 0] = nll
        out[r, 1] = nll_base
        out[r, 2] = acc
        out[r, 3] = np.exp(-nll) - np.exp(-nll_base)
        out[r, 4] = 1.0 if imax == imax_base else 0.0
