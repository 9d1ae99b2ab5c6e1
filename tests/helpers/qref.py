"""numpy references for the integer matmul: ggml's activation rounding and the exact product it implies.

Written from ggml-cpu's x86 quantize_row_q8_0 / _q8_1 (id = 127 / amax, round half to even,
f16 d; q8_1's s = f16(d * sum q)) and quantize_row_q8_K_ref (first x of largest |x|,
iscale = -127 / max, min(127, round), d = 1 / iscale), element by element in float32.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.qlayout import ACT_Q8_1, ACT_Q8_K, FORMATS


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
