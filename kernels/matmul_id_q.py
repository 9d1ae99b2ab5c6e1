"""ggml_mul_mat_id on the integer kernel: every selected expert of a ubatch in one kernel launch.

Why: a decoded token of a mixture-of-experts model multiplies its activation row by k expert
matrices (OLMoE: 8 for gate|up, 8 for down, per layer). Run as k separate matmuls, the same
row is quantized k times and each small product is a launch of its own (the serial / parallel
choice, numba's dispatch, an OpenMP wake-up). llama.cpp's mul_mat_id quantizes the activation
once and splits the (expert, rows) work of all k experts over its threads in one go; so does
this kernel.

Inputs: the experts' packed weights stacked, q [E, G, n_sub, bytes] (d, m, sc, mn likewise:
expert e's arrays are q[e] ... as kernels/qlayout.repack_int packs them); x f32 [n_x, k], the
activation rows, each quantized once (kernels/quant_act.py); the (token, slot) pairs in the
order their results are written, y f32 [P, M]: pair p reads row src[p] of x, and segment s of
the pairs, seg_p[s] .. seg_p[s + 1] - 1, all run expert seg_e[s]. The work items are each
segment's (32-row group, token chunk) items of kernels/matmul_int._run_items, segment after
segment, cut into n_runs runs (one prange iteration each). A pair's row is computed by
_row / _row4 from its own quantized row alone, so it is bit-identical to that expert's
QMatrix.matmul of the row, whatever else is in the launch (tests/test_matmul_id_q.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvchat.kernels.matmul_int import _quantize_rows, _run_items, fmt_get


@njit(cache=True, inline="always")
def _gathered(xq, xd, xs, xm, src):
    """The quantized rows of the pairs: row p of each output is row src[p] of the input (the
    inputs themselves when src is 0, 1, 2 ...: each pair has its own row, in order). Plain
    element loops on one thread: numba's row-slice assignments, and a prange here, doubled the
    twins' compile time for a copy of a few MB at most."""
    P = src.shape[0]
    same = P == xq.shape[0]
    for p in range(P):
        if not same:
            break
        same = src[p] == p
    if same:
        return xq, xd, xs, xm
    gq = np.empty((P, xq.shape[1]), np.int8)  # [P, k]
    gd = np.empty((P, xd.shape[1]), np.float32)  # [P, k / 32 or k / 256]
    gs = np.empty((P, xs.shape[1]), np.int32)  # [P, k / 16]
    gm = np.empty((P, xm.shape[1]), np.float32)  # [P, k / 32]
    for p in range(P):
        r = src[p]
        for j in range(xq.shape[1]):
            gq[p, j] = xq[r, j]
        for j in range(xd.shape[1]):
            gd[p, j] = xd[r, j]
        for j in range(xs.shape[1]):
            gs[p, j] = xs[r, j]
        for j in range(xm.shape[1]):
            gm[p, j] = xm[r, j]
    return gq, gd, gs, gm


@njit(cache=True, inline="always")
def _item_starts(n_groups, seg_p, token_chunk):
    """i64 [S + 1]: the first work item of each segment (and the total): G * token chunks each."""
    S = seg_p.shape[0] - 1
    item0 = np.empty(S + 1, np.int64)
    item0[0] = 0
    for s in range(S):
        n = seg_p[s + 1] - seg_p[s]
        item0[s + 1] = item0[s] + n_groups * ((n + token_chunk - 1) // token_chunk)
    return item0


@njit(cache=True)
def _run_expert_items(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, seg_e, seg_p, item0, y, token_chunk, i0, i1):
    """Work items i0 .. i1 - 1 of the launch: each segment's share through _run_items on its
    expert's arrays and its pairs' rows (C-contiguous views: the same compiled _run_items as
    matmul_q's)."""
    s = np.searchsorted(item0, i0, side="right") - 1  # the segment holding item i0
    while i0 < i1:
        e, p0, p1 = seg_e[s], seg_p[s], seg_p[s + 1]
        j1 = min(i1, item0[s + 1])
        if j1 > i0:
            _run_items(
                isa,
                fmt,
                q[e],
                d[e],
                m[e],
                sc[e],
                mn[e],
                x32[p0:p1],
                xd[p0:p1],
                xs[p0:p1],
                xm[p0:p1],
                y[p0:p1],
                token_chunk,
                i0 - item0[s],
                j1 - item0[s],
                True,  # as matmul_q's call: the same compiled _run_items
            )
        i0 = j1
        s += 1


@njit(parallel=True, cache=True)
def matmul_id_q(isa, fmt, q, d, m, sc, mn, x, src, seg_e, seg_p, y, token_chunk, n_runs):
    """y f32 [P, M]: y[p] = x[src[p]] @ W[e].T for the pairs p of each segment (module docstring),
    over every thread. isa, fmt: as kernels/matmul_int.matmul_q; src, seg_e, seg_p i64."""
    xq, xd, xs, xm = _quantize_rows(x, fmt_get(fmt, "act"), True)
    gq, gd, gs, gm = _gathered(xq, xd, xs, xm, src)
    item0 = _item_starts(q.shape[1], seg_p, token_chunk)
    n_items = item0[-1]
    n_par = max(1, min(n_items, n_runs))
    x32 = gq.view(np.int32)  # [P, k / 4]
    for p in prange(n_par):
        _run_expert_items(
            isa,
            fmt,
            q,
            d,
            m,
            sc,
            mn,
            x32,
            gd,
            gs,
            gm,
            seg_e,
            seg_p,
            item0,
            y,
            token_chunk,
            p * n_items // n_par,
            (p + 1) * n_items // n_par,
        )


@njit(cache=True)
def matmul_id_q_serial(isa, fmt, q, d, m, sc, mn, x, src, seg_e, seg_p, y, token_chunk):
    """matmul_id_q on the calling thread only (small products: no parallel launch); same results."""
    xq, xd, xs, xm = _quantize_rows(x, fmt_get(fmt, "act"), False)
    gq, gd, gs, gm = _gathered(xq, xd, xs, xm, src)
    item0 = _item_starts(q.shape[1], seg_p, token_chunk)
    _run_expert_items(
        isa,
        fmt,
        q,
        d,
        m,
        sc,
        mn,
        gq.view(np.int32),
        gd,
        gs,
        gm,
        seg_e,
        seg_p,
        item0,
        y,
        token_chunk,
        np.int64(0),
        item0[-1],
    )
