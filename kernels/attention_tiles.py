"""Tile-level pieces of the attention kernels (kernels/attention.py): decoding KT cache rows of one
kv head into an f32 tile, the K·q scores of up to four queries, the masked/scaled scores, a
tile's share of an online softmax, and the exp they use.

All of it is strict IEEE arithmetic (no fast-math) or the explicit vectors of kernels/simd.py,
so every result is fixed by the source, whichever kernel inlines it — the basis of the batch
invariance described in kernels/attention.py. Tiles are always KT cells wide.
"""
import math

import numpy as np
from numba import njit

from kernels.ggml_types import GGMLType
from kernels.quants import (
    dequant_row_bf16,
    dequant_row_f32,
    dequant_row_iq4_nl,
    dequant_row_q4_0,
    dequant_row_q4_1,
    dequant_row_q5_0,
    dequant_row_q5_1,
    dequant_row_q8_0,
)
from kernels.quants_fp import bits_to_f32, f32_to_bits
from kernels.simd import LANES, vadd, vbcast, vfma, vhsum, vload, vstore, vzero

KT = 32  # cells per tile: two vectors of kernels/simd.py
assert KT == 2 * LANES
NEG_INF = np.float32(-np.inf)
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: x + _ROUND - _ROUND rounds |x| < 2^22 to an integer

_F32, _F16, _BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
_Q4_0, _Q4_1, _Q5_0 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0)
_Q5_1, _Q8_0, _IQ4_NL = int(GGMLType.Q5_1), int(GGMLType.Q8_0), int(GGMLType.IQ4_NL)


@njit(cache=True)
def _f16_row_fast(src, dst):
    """f16 bytes -> f32, branch-free so LLVM vectorizes it (the K/V hot loop of f16 caches).
    Exact for every half: the 15 magnitude bits shifted into a float and scaled by 2^112 give
    normals and subnormals alike; exponent 31 (inf/NaN) is patched by a select."""
    for i in range(dst.shape[0]):
        h = np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))
        mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
        f = bits_to_f32(mag) * np.float32(5.192296858534828e33)  # 2^112
        fb = f32_to_bits(f)
        fb = (np.uint32(0x7F800000) | mag) if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) else fb
        dst[i] = bits_to_f32(fb | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True)
def dequant_cache_row(t, src, dst):
    """Dequantize one cache row fragment src (u8) of format t into dst (f32).
    Only the cache formats are dispatched (smaller than quants.dequant_row_any: shorter compile)."""
    if t == _F16:
        _f16_row_fast(src, dst)
    elif t == _Q8_0:
        dequant_row_q8_0(src, dst)
    elif t == _Q4_0:
        dequant_row_q4_0(src, dst)
    elif t == _F32:
        dequant_row_f32(src, dst)
    elif t == _BF16:
        dequant_row_bf16(src, dst)
    elif t == _Q4_1:
        dequant_row_q4_1(src, dst)
    elif t == _Q5_0:
        dequant_row_q5_0(src, dst)
    elif t == _Q5_1:
        dequant_row_q5_1(src, dst)
    elif t == _IQ4_NL:
        dequant_row_iq4_nl(src, dst)


@njit(cache=True)
def tile_live(mask, t0, t1, j0, j1):
    """True if any token of [t0, t1) may see any cell of [j0, j1)."""
    for t in range(t0, t1):
        for j in range(j0, j1):
            if mask[t, j] != NEG_INF:
                return True
    return False


@njit(cache=True, inline="always")
def exp_le0(x):
    """exp(x) for x <= 0 (or -inf -> 0), branch-free so that loops over a tile vectorize (numba has
    no vector exp here). Cody-Waite reduction x = n*ln2 + r (n rounded by adding and subtracting
    1.5 * 2^23, which needs the strict arithmetic these kernels use), a degree-6 polynomial on
    |r| <= ln2/2 (about 1 ulp), plain IEEE arithmetic in the order written."""
    xc = max(x, np.float32(-87.0))
    n = (xc * np.float32(1.4426950408889634) + _ROUND) - _ROUND  # nearest integer (strict IEEE)
    r = xc - n * np.float32(0.693359375)
    r = r + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r) + np.float32(1.0)
    y = y * bits_to_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return y if x > np.float32(-87.0) else np.float32(0.0)


@njit(cache=True, inline="always")
def _f16_bits(h):
    """f16 bit pattern (u32) -> f32, exact and branch-free (see _f16_row_fast)."""
    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
    fb = f32_to_bits(bits_to_f32(mag) * np.float32(5.192296858534828e33))  # 2^112
    fb = (np.uint32(0x7F800000) | mag) if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) else fb
    return bits_to_f32(fb | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True, inline="always")
def load_tile(t, raw, st, j0, nj, b0, nb, dst):
    """Dequantize bytes [b0, b0+nb) of cache rows j0..j0+nj of stream st into dst[:nj] (f32 [KT, d]);
    rows nj..KT become zeros. f16 (one vcvtph2ps per 16 values) and q8_0 (int8 -> f32 times the
    block scale) are decoded with vectors straight from the cache; other formats per row. Every
    decode is exact, so how it is compiled cannot change a value."""
    d = dst.shape[1]
    if t == _F16:
        r16 = raw.view(np.uint16)  # [n_stream, n_kv, row_bytes / 2] f16 bits (rows are even)
        for j in range(nj):
            o = (st * raw.strides[0] + (j0 + j) * raw.strides[1] + b0) // 2  # flat u16 index
            for i in range(0, d, LANES):
                vstore(dst, j * d + i, vload(r16, o + i))
    elif t == _Q8_0:
        r8 = raw.view(np.int8)
        for j in range(nj):
            o = st * raw.strides[0] + (j0 + j) * raw.strides[1] + b0  # flat byte index
            for b in range(d // 32):  # block: f16 scale, 32 int8
                sc = vbcast(_f16_bits(np.uint32(raw[st, j0 + j, b0 + b * 34])
                                      | (np.uint32(raw[st, j0 + j, b0 + b * 34 + 1]) << np.uint32(8))))
                for h in range(0, 32, LANES):  # int8 * scale is exact in f32
                    vstore(dst, j * d + b * 32 + h, vfma(vload(r8, o + b * 34 + 2 + h), sc, vzero()))
    else:
        tmp = np.empty(d, dtype=np.float32)  # [d] one row (dst itself is never handed to a call)
        for j in range(nj):
            dequant_cache_row(t, raw[st, j0 + j, b0:b0 + nb], tmp)
            for i in range(d):
                dst[j, i] = tmp[i]
    for j in range(nj, KT):  # past the last cell: zeros, so a full-width tile stays finite
        for i in range(d):
            dst[j, i] = 0.0


@njit(cache=True, inline="always")
def mask_tile(mask, t0, t1, j0, nj, mt):
    """mt[t - t0, j] <- mask[t, j0 + j] for the tile's cells, -inf past the last cell (j >= nj)."""
    for t in range(t0, t1):
        for j in range(KT):
            mt[t - t0, j] = mask[t, j0 + j] if j < nj else NEG_INF


@njit(cache=True, inline="always")
def tile_dots1(qb, qi, kt, x, off, stride):
    """x[off + j] = qb[qi]·kt[j] for the KT cells of a tile (kt [KT, dk] f32): per cell, lane l
    is an fma chain over components l, l+16, ... in order, then one fixed tree (vhsum).
    tile_dots1/2/4 share this signature: query qi + r's scores go to x[off + r * stride:][:KT]
    (stride is unused here, with one query)."""
    dk = qb.shape[1]
    for j in range(KT):
        a = vzero()
        for e in range(0, dk, LANES):
            a = vfma(vload(qb, qi * dk + e), vload(kt, j * dk + e), a)
        x[off + j] = vhsum(a)


@njit(cache=True, inline="always")
def tile_dots2(qb, qi, kt, x, off, stride):
    """tile_dots1 for queries qi and qi + 1 at once (one K load feeds two fma chains); each
    query's chain is the very sequence tile_dots1 computes, so the results are the same bits."""
    dk = qb.shape[1]
    for j in range(KT):
        a = vzero()
        b = vzero()
        for e in range(0, dk, LANES):
            kv = vload(kt, j * dk + e)
            a = vfma(vload(qb, qi * dk + e), kv, a)
            b = vfma(vload(qb, (qi + 1) * dk + e), kv, b)
        x[off + j] = vhsum(a)
        x[off + stride + j] = vhsum(b)


@njit(cache=True, inline="always")
def tile_dots4(qb, qi, kt, x, off, stride):
    """tile_dots1 for queries qi .. qi + 3 (results at off, off + stride, ...): one K load feeds
    four fma chains, each the very sequence tile_dots1 computes for its query."""
    dk = qb.shape[1]
    for j in range(KT):
        a = vzero()
        b = vzero()
        c = vzero()
        d = vzero()
        for e in range(0, dk, LANES):
            kv = vload(kt, j * dk + e)
            a = vfma(vload(qb, qi * dk + e), kv, a)
            b = vfma(vload(qb, (qi + 1) * dk + e), kv, b)
            c = vfma(vload(qb, (qi + 2) * dk + e), kv, c)
            d = vfma(vload(qb, (qi + 3) * dk + e), kv, d)
        x[off + j] = vhsum(a)
        x[off + stride + j] = vhsum(b)
        x[off + 2 * stride + j] = vhsum(c)
        x[off + 3 * stride + j] = vhsum(d)


@njit(cache=True, inline="always")
def _tile_sum(x, off):
    """Sum of the KT values x[off:off+KT] in one fixed tree."""
    return vhsum(vadd(vload(x, off), vload(x, off + LANES)))


@njit(cache=True, inline="always")
def tile_scores(x, off, mt, mr, scale, softcap):
    """x[off + j] <- scale * dot (or soft-capped) + mask row mt[mr], for the KT cells of a tile;
    returns the tile's max."""
    m = NEG_INF
    for j in range(KT):
        d = x[off + j]
        if softcap != 0.0:
            d = softcap * np.float32(math.tanh(d * (scale / softcap)))
        else:
            d = d * scale
        s = d + mt[mr, j]
        x[off + j] = s
        m = max(m, s)
    return m


@njit(cache=True, inline="always")
def online_update(qi, m_tile, sc, so, vt, mx, sm, acc):
    """Add a tile to query qi's online softmax (mx, sm, acc [nq, dv]): sc[so:so+KT] holds the
    tile's scores (max m_tile > -inf) and becomes its probabilities; vt [KT, dv] the V rows."""
    dv = acc.shape[1]
    if mx[qi] == NEG_INF:  # first visible tile of the chunk
        mx[qi] = m_tile
        sm[qi] = 0.0
        for e in range(dv):
            acc[qi, e] = 0.0
    elif m_tile > mx[qi]:
        r = exp_le0(mx[qi] - m_tile)
        sm[qi] *= r
        for e in range(dv):
            acc[qi, e] *= r
        mx[qi] = m_tile
    m_new = mx[qi]
    for j in range(KT):
        sc[so + j] = exp_le0(sc[so + j] - m_new)
    sm[qi] += _tile_sum(sc, so)
    o = qi * dv
    e0 = 0
    while e0 + 4 * LANES <= dv:  # acc[qi, e] += p_j * v_j[e], cells in order; 64 components at once
        a0 = vload(acc, o + e0)
        a1 = vload(acc, o + e0 + LANES)
        a2 = vload(acc, o + e0 + 2 * LANES)
        a3 = vload(acc, o + e0 + 3 * LANES)
        for j in range(KT):
            p = sc[so + j]
            if p != 0.0:
                pb = vbcast(p)
                a0 = vfma(pb, vload(vt, j * dv + e0), a0)
                a1 = vfma(pb, vload(vt, j * dv + e0 + LANES), a1)
                a2 = vfma(pb, vload(vt, j * dv + e0 + 2 * LANES), a2)
                a3 = vfma(pb, vload(vt, j * dv + e0 + 3 * LANES), a3)
        vstore(acc, o + e0, a0)
        vstore(acc, o + e0 + LANES, a1)
        vstore(acc, o + e0 + 2 * LANES, a2)
        vstore(acc, o + e0 + 3 * LANES, a3)
        e0 += 4 * LANES
    while e0 < dv:  # the same chain for a remainder of 16 or 32 components
        a = vload(acc, o + e0)
        for j in range(KT):
            p = sc[so + j]
            if p != 0.0:
                a = vfma(vbcast(p), vload(vt, j * dv + e0), a)
        vstore(acc, o + e0, a)
        e0 += LANES
