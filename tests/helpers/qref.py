"""numpy references for the integer matmul: ggml's activation rounding and the exact product it implies.

Written from ggml-cpu's x86 quantize_row_q8_0 / _q8_1 (id = 127 / amax, round half to even,
f16 d; q8_1's s = f16(d * sum q)) and quantize_row_q8_K_ref (first x of largest |x|,
iscale = -127 / max, min(127, round), d = 1 / iscale), element by element in float32.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.qlayout import ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, FORMATS


def quantize_act(x: np.ndarray, act: int):
    """x f32 [n, k] -> (q i8 [n, k], d f32 [n, nb], s16 i32 [n, k / 16], s f32 [n, k / 32] or None)."""
    x = np.asarray(x, np.float32)
    n, k = x.shape
    bs = 256 if act == ACT_Q8_K else 32
    xb = x.reshape(n, k // bs, bs)
    if act == ACT_Q8_K:
        i = np.argmax(np.abs(xb), axis=2)  # first index of the largest |x|
        mx = np.take_along_axis(xb, i[..., None], 2)[..., 0]
        with np.errstate(divide="ignore"):
            iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
        q = np.minimum(127, np.rint(iscale[..., None] * xb)).astype(np.int8)
        with np.errstate(divide="ignore"):
            d = np.where(mx == 0, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
        s = None
    else:
        amax = np.abs(xb).max(axis=2)
        d32 = (amax / np.float32(127.0)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idd = np.where(amax == 0, np.float32(0), np.float32(127.0) / amax).astype(np.float32)
        q = np.rint(xb * idd[..., None]).astype(np.int8)
        d = d32.astype(np.float16).astype(np.float32)
        s = None
        if act == ACT_Q8_1:
            s = (d32 * q.astype(np.int32).sum(2).astype(np.float32)).astype(np.float16).astype(np.float32)
    q = q.reshape(n, k)
    s16 = q.astype(np.int32).reshape(n, k // 16, 16).sum(2)
    return q, d, s16, s


def dequantized_act(x: np.ndarray, t: int) -> np.ndarray:
    """The activations the integer kernel really multiplies: q * d, float64 [n, k]."""
    fmt = FORMATS[GGMLType(t)]
    q, d, _, _ = quantize_act(x, fmt.act)
    bs = 256 if fmt.act == ACT_Q8_K else 32
    n, k = q.shape
    return (q.astype(np.float64).reshape(n, k // bs, bs) * d[..., None].astype(np.float64)).reshape(n, k)


def int_matmul_reference(raw: np.ndarray, t: int, k: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exact float64 value of the kernel's product, |.| bound base) for weights raw of type t.

    The value is dequantize(W) (gguf-py) times the quantized activations; for q4_1 / q5_1 the
    offset term uses q8_1's f16 s as ggml does (m * s instead of m * d * sum q)."""
    t = GGMLType(t)
    w = np.asarray(gguf_dequantize(raw, t), np.float64).reshape(raw.shape[0], k)
    xa = dequantized_act(x, t)
    y = xa @ w.T
    base = np.abs(xa) @ np.abs(w).T
    if FORMATS[t].act == ACT_Q8_1:
        q, d, _, s = quantize_act(x, ACT_Q8_1)
        nb = k // 32
        mw = np.ascontiguousarray(raw.reshape(raw.shape[0], nb, -1)[:, :, 2:4]).view(np.float16)[..., 0]
        qsum = q.astype(np.float64).reshape(q.shape[0], nb, 32).sum(2)
        corr = s.astype(np.float64) - d.astype(np.float64) * qsum  # [n, nb]
        y = y + corr @ mw.astype(np.float64).T
        base = base + np.abs(s.astype(np.float64)) @ np.abs(mw.astype(np.float64)).T
    return y, base


def fma32(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c) lane by lane, exactly: a * b is exact in float64, the float64 sum s
    rounds at most once (its error e by TwoSum), and where s lands on a float32 tie that a
    nonzero e breaks, the tie goes e's way (a plain float64 -> float32 cast would round twice)."""
    a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - p
    e = (p - (s - bp)) + (c64 - bp)
    r = s.astype(np.float32)
    other = np.nextafter(r, np.where(s > r, np.float32(np.inf), np.float32(-np.inf)))
    tie = (s != r) & (s == (r.astype(np.float64) + other.astype(np.float64)) / 2) & (e != 0)
    up, down = np.maximum(r, other), np.minimum(r, other)
    return np.where(tie, np.where(e > 0, up, down), r).astype(np.float32)


def ggml_q4_1_q8_1(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y f32 [n, m]: Q4_1 rows raw u8 [m, k / 32 * 20] times x f32 [n, k] exactly as ggml-cpu's x86
    AVX2 ggml_vec_dot_q4_1_q8_1 computes each output: x quantized to q8_1, then per block b
    8 float lanes acc_l = fma(d_w * d_x, float(sum of values 4l .. 4l+3 times their q), acc_l)
    (values 0-15 the low nibbles, 16-31 the high ones), hsum_float_8's tree
    ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), plus summs = the in-order float32 sum of
    m_w * s_x."""
    m = raw.shape[0]
    n, k = x.shape
    nb = k // 32
    blocks = raw.reshape(m, nb, 20)
    dw = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    mw = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[:, :, 4:20]
    vals = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)  # [m, nb, 32]
    q, d, _, s = quantize_act(x, ACT_Q8_1)
    qx = q.reshape(n, nb, 32).astype(np.int64)
    lanes = (vals[None] * qx[:, None]).reshape(n, m, nb, 8, 4).sum(-1).astype(np.float32)  # [n, m, nb, 8]
    dd = dw[None] * d[:, None]  # float32 products [n, m, nb]
    acc = np.zeros((n, m, 8), np.float32)
    summs = np.zeros((n, m), np.float32)
    for b in range(nb):
        acc = fma32(dd[:, :, b, None], lanes[:, :, b], acc)
        summs = summs + mw[None, :, b] * s[:, None, b]
    a = [acc[..., i] for i in range(8)]
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) + summs


def q0_values(raw: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(d f32 [m, nb], signed values i64 [m, nb, 32]) of Q5_0 or Q8_0 rows raw u8 [m, nb * block bytes]."""
    t = GGMLType(t)
    m = raw.shape[0]
    if t == GGMLType.Q8_0:
        blocks = raw.reshape(m, -1, 34)
        vals = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.int64)
    elif t == GGMLType.Q5_0:
        blocks = raw.reshape(m, -1, 22)
        qh = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")[..., 0].astype(np.int64)  # [m, nb]
        qs = blocks[:, :, 6:22].astype(np.int64)
        nib = np.concatenate([qs & 15, qs >> 4], axis=2)  # values 0-15 low nibbles, 16-31 high
        hb = (qh[..., None] >> np.arange(32)) & 1
        vals = (nib | (hb << 4)) - 16
    else:
        raise ValueError(t)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    return d, vals


def ggml_q0_q8_0_batch(raw: np.ndarray, t: int, x: np.ndarray) -> np.ndarray:
    """y f32 [n, m]: Q5_0 / Q8_0 rows raw times x f32 [n, k] exactly as llamafile's
    tinyBLAS_Q0_AVX (ggml-cpu/llamafile/sgemm.cpp) computes a batch of >= 2 tokens on x86: x
    quantized to q8_0, then per output 8 float lanes, lane l the integer dot of values 4l .. 4l+3
    of each block (updot), acc_l = fma(d_w * d_x, float(lane), acc_l) over the blocks in order
    from +0 (madd), and hsum(__m256): ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    d_w, vals = q0_values(raw, t)
    m, nb, _ = vals.shape
    n, k = x.shape
    q, d, _, _ = quantize_act(x, ACT_Q8_0)
    qx = q.reshape(n, nb, 32).astype(np.int64)
    lanes = (vals[None] * qx[:, None]).reshape(n, m, nb, 8, 4).sum(-1).astype(np.float32)  # [n, m, nb, 8]
    dd = d_w[None] * d[:, None]  # float32 products [n, m, nb]
    acc = np.zeros((n, m, 8), np.float32)
    for b in range(nb):
        acc = fma32(dd[:, :, b, None], lanes[:, :, b], acc)
    a = [acc[..., i] for i in range(8)]
    return ((a[4] + a[0]) + (a[6] + a[2])) + ((a[5] + a[1]) + (a[7] + a[3]))


def q4_K_parts(raw: np.ndarray):
    """Q4_K rows raw u8 [m, nB * 144] -> (d, dmin f32 [m, nB], sc, mn i64 [m, nB, 8], values i64 [m, nB, 8, 32])."""
    m = raw.shape[0]
    blocks = raw.reshape(m, -1, 144)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    q = blocks[:, :, 4:16].astype(np.int64)  # 12 scale bytes
    sc = np.empty(q.shape[:2] + (8,), np.int64)
    mn = np.empty_like(sc)
    for j in range(8):  # ggml's get_scale_min_k4
        if j < 4:
            sc[..., j] = q[..., j] & 63
            mn[..., j] = q[..., j + 4] & 63
        else:
            sc[..., j] = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
            mn[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
    qs = blocks[:, :, 16:144].astype(np.int64).reshape(m, -1, 4, 32)  # 4 chunks of 64 values
    vals = np.stack([qs & 15, qs >> 4], axis=3).reshape(m, -1, 8, 32)  # sub-block 2c: low, 2c + 1: high
    return d, dmin, sc, mn, vals


def ggml_q4_K_repacked(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y f32 [n, m]: Q4_K rows times x f32 [n, k] as ggml-cpu's x86 repacked gemm
    (arch/x86/repack.cpp ggml_gemm_q4_K_8x8_q8_K, 4 tokens and more) computes each output:
    x quantized to q8_K; per pair of sub-blocks (64 values, 4 a super-block B) the exact integers
    I = sum_j sc_j * (values_j . q_j) and M = sum_j mn_j * sum(q_j) over its two sub-blocks j;
    acc = fma(float(I), d_w * d_x, acc), acc_min = fma(float(M), dmin_w * d_x, acc_min), both from
    +0 in order; the output acc - acc_min. (The one-token gemv steps per super-block.)"""
    d_w, dmin_w, sc, mn, vals = q4_K_parts(raw)
    m, nB = d_w.shape
    n, k = x.shape
    q, d, _, _ = quantize_act(x, ACT_Q8_K)
    qx = q.reshape(n, nB, 8, 32).astype(np.int64)
    dots = np.einsum("mbjv,nbjv->nmbj", vals, qx)  # [n, m, nB, 8] exact
    ii = (dots * sc[None]).reshape(n, m, nB, 4, 2).sum(-1)  # [n, m, nB, 4 pairs]
    mm = (qx.sum(-1)[:, None] * mn[None]).reshape(n, m, nB, 4, 2).sum(-1)
    acc = np.zeros((n, m), np.float32)
    accm = np.zeros((n, m), np.float32)
    for b in range(nB):
        for sb in range(4):
            acc = fma32(ii[:, :, b, sb].astype(np.float32), d_w[None, :, b] * d[:, None, b], acc)
            accm = fma32(mm[:, :, b, sb].astype(np.float32), dmin_w[None, :, b] * d[:, None, b], accm)
    return acc - accm


def q6_K_parts(raw: np.ndarray):
    """Q6_K rows raw u8 [m, nB * 210] -> (d f32 [m, nB], sc i64 [m, nB, 16], signed values i64 [m, nB, 256])."""
    m = raw.shape[0]
    blocks = raw.reshape(m, -1, 210)
    ql = blocks[:, :, 0:128].astype(np.int64).reshape(m, -1, 2, 64)
    qh = blocks[:, :, 128:192].astype(np.int64).reshape(m, -1, 2, 32)
    sc = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).astype(np.int64)
    d = np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16)[..., 0].astype(np.float32)
    lo, hi = ql[..., :32], ql[..., 32:]
    parts = [  # values 0-31, 32-63, 64-95, 96-127 of each half (ggml's dequantize_row_q6_K)
        (lo & 15) | (((qh >> 0) & 3) << 4),
        (hi & 15) | (((qh >> 2) & 3) << 4),
        (lo >> 4) | (((qh >> 4) & 3) << 4),
        (hi >> 4) | (((qh >> 6) & 3) << 4),
    ]
    vals = np.concatenate(parts, axis=-1).reshape(m, -1, 256) - 32
    return d, sc, vals


def ggml_q6_K_tiled(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y f32 [n, m]: Q6_K rows times x f32 [n, k] as ggml-cpu's tiled K-quant matmul
    (tiled/tiled-kernel.cpp, VNNI microtile; llama.cpp's x86 path for q6_K and >= 8 tokens)
    computes each output: x quantized to q8_K; per super-block B the exact integer
    I = sum_s sc_s * (values_s . q_s) over its 16 sub-blocks; acc = fma(float(I) * d_w, d_x, acc),
    from +0 in block order (the microtile's buf + result * d_x, which GCC contracts to an fma:
    this equals llama.cpp's layer-0 ffn_down of Gemma-3 bit for bit, the unfused form does not)."""
    d_w, sc, vals = q6_K_parts(raw)
    m, nB = d_w.shape
    n, k = x.shape
    q, d, _, _ = quantize_act(x, ACT_Q8_K)
    qx = q.reshape(n, nB, 16, 16).astype(np.int64)
    dots = np.einsum("mbsv,nbsv->nmbs", vals.reshape(m, nB, 16, 16), qx)  # [n, m, nB, 16] exact
    ii = (dots * sc[None]).sum(-1)  # [n, m, nB]
    acc = np.zeros((n, m), np.float32)
    for b in range(nB):
        acc = fma32(ii[:, :, b].astype(np.float32) * d_w[None, :, b], np.broadcast_to(d[:, None, b], acc.shape), acc)
    return acc
