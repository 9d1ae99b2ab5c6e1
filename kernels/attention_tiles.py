"""Tile-level pieces of the attention kernels (kernels/attention.py): decoding KT cache rows of one
kv head into an f32 tile, the K·q scores of up to four queries, the masked/scaled scores, a
tile's share of an online softmax, and the exp they use.

All of it is strict IEEE arithmetic (no fast-math) or the explicit vectors of kernels/simd.py,
so every result is fixed by the source, whichever kernel inlines it — the basis of the batch
invariance described in kernels/attention.py. Tiles are always KT cells wide.
"""

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.quants import (
    dequant_row_bf16,
    dequant_row_f32,
    dequant_row_iq4_nl,
    dequant_row_q4_0,
    dequant_row_q4_1,
    dequant_row_q5_0,
    dequant_row_q5_1,
    dequant_row_q8_0,
)
from kvchat.kernels.quants_fp import bits_to_f32, f32_to_bits
from kvchat.kernels.simd import (
    LANES,
    prefetch,
    vadd,
    vany_eq0,
    vbcast,
    vexp_le0,
    vfma,
    vhmax,
    vhsum,
    vhsum16,
    vload,
    vmax,
    vmul,
    vstore,
    vsub,
    vzero,
)

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
def row_values(t, nb):
    """How many values nb bytes of a cache row in format t hold (a cache format's block sizes)."""
    if t == _F32:
        return nb // 4
    if t == _F16 or t == _BF16:
        return nb // 2
    if t == _Q8_0:
        return nb // 34 * 32
    if t == _Q4_0 or t == _IQ4_NL:
        return nb // 18 * 32
    if t == _Q4_1:
        return nb // 20 * 32
    if t == _Q5_0:
        return nb // 22 * 32
    return nb // 24 * 32  # q5_1


def load_tile(t, raw, st, j0, nj, b0, nb, dst):
    """Dequantize bytes [b0, b0+nb) of cache rows j0..j0+nj of stream st — d values each — into
    dst[:nj, :d] (f32 [KT, dp], dp = d rounded up to LANES); rows nj..KT become zeros. Columns
    d..dp are never written: the caller allocates dst zeroed, so a head size that is not a
    multiple of LANES reads as one padded with zero components, which add exactly nothing to a
    K·q chain or a P·V component that is then dropped. f16 (one vcvtph2ps per 16 values) and
    q8_0 (int8 -> f32 times the block scale) are decoded with vectors straight from the cache;
    other formats per row. Every decode is exact, so how it is compiled cannot change a value.
    t: the cache's ggml type, a run-time int (every format's code compiled in) or f16 as a
    compile-time constant (quants.kernel_cache_types: only f16's code compiled, the same code)."""
    raise NotImplementedError("only callable inside njit code")


@overload(load_tile, inline="always", prefer_literal=True)  # else numba tries the unliteral int first
def _load_tile(t, raw, st, j0, nj, b0, nb, dst):
    if isinstance(t, types.IntegerLiteral) and t.literal_value == _F16:
        return lambda t, raw, st, j0, nj, b0, nb, dst: _load_f16(raw, st, j0, nj, b0, nb, dst)
    if isinstance(t, types.Integer):
        return lambda t, raw, st, j0, nj, b0, nb, dst: _load_any(t, raw, st, j0, nj, b0, nb, dst)
    return None


@njit(cache=True, forceinline=True, _nrt=False)
def _f16_rows(raw, st, j0, nj, b0, d, dst):
    """dst[:nj, :d] <- d f16 values of cache rows j0 .. j0 + nj - 1 from byte b0 (load_tile)."""
    dp = dst.shape[1]
    r16 = raw.view(np.uint16)  # [n_stream, n_kv, row_bytes / 2] f16 bits (rows are even)
    d16 = d - d % LANES
    for j in range(nj):
        o = (st * raw.strides[0] + (j0 + j) * raw.strides[1] + b0) // 2  # flat u16 index
        for i in range(0, d16, LANES):
            vstore(dst, j * dp + i, vload(r16, o + i))
        for i in range(d16, d):  # a head size that is not a multiple of LANES: the tail
            dst[j, i] = _f16_bits(np.uint32(r16[st, j0 + j, b0 // 2 + i]))


@njit(cache=True, forceinline=True, _nrt=False)
def _zero_rows(nj, dst):
    """Rows nj .. KT of dst past the last cell become zeros, so a full-width tile stays finite."""
    for j in range(nj, KT):
        for i in range(dst.shape[1]):
            dst[j, i] = 0.0


@njit(cache=True, forceinline=True, _nrt=False)
def _load_f16(raw, st, j0, nj, b0, nb, dst):
    """load_tile of an f16 cache."""
    _f16_rows(raw, st, j0, nj, b0, nb // 2, dst)
    _zero_rows(nj, dst)


@njit(cache=True, forceinline=True)
def _load_any(t, raw, st, j0, nj, b0, nb, dst):
    """load_tile of a cache of any type t (a run-time int)."""
    dp = dst.shape[1]
    d = row_values(t, nb)
    if t == _F16:
        _f16_rows(raw, st, j0, nj, b0, d, dst)
    elif t == _Q8_0:
        r8 = raw.view(np.int8)
        for j in range(nj):
            o = st * raw.strides[0] + (j0 + j) * raw.strides[1] + b0  # flat byte index
            for b in range(d // 32):  # block: f16 scale, 32 int8
                sc = vbcast(
                    _f16_bits(
                        np.uint32(raw[st, j0 + j, b0 + b * 34])
                        | (np.uint32(raw[st, j0 + j, b0 + b * 34 + 1]) << np.uint32(8))
                    )
                )
                for h in range(0, 32, LANES):  # int8 * scale is exact in f32
                    vstore(dst, j * dp + b * 32 + h, vfma(vload(r8, o + b * 34 + 2 + h), sc, vzero()))
    else:
        tmp = np.empty(d, dtype=np.float32)  # [d] one row (dst itself is never handed to a call)
        for j in range(nj):
            dequant_cache_row(t, raw[st, j0 + j, b0 : b0 + nb], tmp)
            for i in range(d):
                dst[j, i] = tmp[i]
    _zero_rows(nj, dst)


@njit(cache=True, forceinline=True, _nrt=False)
def mask_tile(mask, t0, t1, j0, nj, mt):
    """mt[t - t0, j] <- mask[t, j0 + j] for the tile's cells, -inf past the last cell (j >= nj)."""
    for t in range(t0, t1):
        for j in range(KT):
            mt[t - t0, j] = mask[t, j0 + j] if j < nj else NEG_INF


@njit(cache=True, inline="always")
def tile_dots1(qb, qi, kt, x, off, stride):
    """x[off + j] = qb[qi]·kt[j] for the KT cells of a tile (kt [KT, dk] f32): per cell, lane l
    is an fma chain over components l, l+16, ... in order, then one fixed tree (vhsum).
    tile_dots1/4 share this signature: query qi + r's scores go to x[off + r * stride:][:KT]
    (stride is unused here, with one query)."""
    dk = qb.shape[1]
    for j in range(KT):
        a = vzero()
        for e in range(0, dk, LANES):
            a = vfma(vload(qb, qi * dk + e), vload(kt, j * dk + e), a)
        x[off + j] = vhsum(a)


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
def _dots16(qb, qi, kt, j0):
    """qb[qi]·kt[j] for the 16 cells j0 .. j0 + 15 of a tile, as one vector (lane i: cell j0 + i):
    each cell's lane chains exactly as tile_dots1's, and vhsum16 sums each the way vhsum does,
    so the 16 scores are tile_dots1's bits without 16 separate horizontal sums."""
    dk = qb.shape[1]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = vzero()
    for e in range(0, dk, LANES):
        qv = vload(qb, qi * dk + e)
        b = j0 * dk + e
        a0 = vfma(qv, vload(kt, b), a0)
        a1 = vfma(qv, vload(kt, b + dk), a1)
        a2 = vfma(qv, vload(kt, b + 2 * dk), a2)
        a3 = vfma(qv, vload(kt, b + 3 * dk), a3)
        a4 = vfma(qv, vload(kt, b + 4 * dk), a4)
        a5 = vfma(qv, vload(kt, b + 5 * dk), a5)
        a6 = vfma(qv, vload(kt, b + 6 * dk), a6)
        a7 = vfma(qv, vload(kt, b + 7 * dk), a7)
        a8 = vfma(qv, vload(kt, b + 8 * dk), a8)
        a9 = vfma(qv, vload(kt, b + 9 * dk), a9)
        a10 = vfma(qv, vload(kt, b + 10 * dk), a10)
        a11 = vfma(qv, vload(kt, b + 11 * dk), a11)
        a12 = vfma(qv, vload(kt, b + 12 * dk), a12)
        a13 = vfma(qv, vload(kt, b + 13 * dk), a13)
        a14 = vfma(qv, vload(kt, b + 14 * dk), a14)
        a15 = vfma(qv, vload(kt, b + 15 * dk), a15)
    return vhsum16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


@njit(cache=True, forceinline=True, _nrt=False)
def query_scores(qb, qi, kt, mt, mr, scale, softcap, x, off):
    """x[off:off + KT] <- the scores of query qi over a K tile (kt [KT, dk]): K·q as tile_dots1,
    then scale (or soft-cap) and mask row mt[mr] as tile_scores, whose bits these are; returns
    the tile's max."""
    d0 = _dots16(qb, qi, kt, np.int64(0))  # i64, not literals: one compiled version for both
    d1 = _dots16(qb, qi, kt, np.int64(LANES))
    if softcap != 0.0:
        vstore(x, off, d0)
        vstore(x, off + LANES, d1)
        return tile_scores(x, off, mt, mr, scale, softcap)
    sb = vbcast(scale)
    m0 = mr * KT
    s0 = vadd(vmul(d0, sb), vload(mt, m0))
    s1 = vadd(vmul(d1, sb), vload(mt, m0 + LANES))
    vstore(x, off, s0)
    vstore(x, off + LANES, s1)
    return vhmax(vmax(s0, s1))


@njit(cache=True, forceinline=True, _nrt=False)
def softmax_step(r, m_tile, sc, so, mx, sm, acc):
    """A tile's online-softmax step for state row r (mx, sm, acc [rows, dv]) up to the P·V: rescale to the new
    max, sc[so:so + KT] scores -> probabilities, their sum added. Returns True if some p is 0
    (a masked or underflowed cell, which the P·V must skip: tile_pv1, as ggml skips masked cells)."""
    dv = acc.shape[1]
    if mx[r] == NEG_INF:  # first visible tile of the chunk
        mx[r] = m_tile
        sm[r] = 0.0
        for e in range(dv):
            acc[r, e] = 0.0
    elif m_tile > mx[r]:
        f = exp_le0(mx[r] - m_tile)
        sm[r] *= f
        for e in range(dv):
            acc[r, e] *= f
        mx[r] = m_tile
    mb = vbcast(mx[r])
    p0 = vexp_le0(vsub(vload(sc, so), mb))  # exp_le0(s - max) of the tile's 32 cells
    p1 = vexp_le0(vsub(vload(sc, so + LANES), mb))
    vstore(sc, so, p0)
    vstore(sc, so + LANES, p1)
    sm[r] += vhsum(vadd(p0, p1))  # _tile_sum's tree
    return vany_eq0(p0, p1)


@njit(cache=True, forceinline=True, _nrt=False)
def tile_pv1(sc, so, vt, acc, r):
    """acc[r, e] += p_j * v_j[e] over the tile's cells in order, cells with p = 0 skipped ."""
    _pv_rest(sc, so, vt, acc, r, np.int64(0))  # i64: tile_pv's version, not a literal's


@njit(cache=True, inline="always")
def _pv_block(n, sc, s0, s1, s2, s3, vt, acc, r0, r1, r2, r3, e0):
    """tile_pv for the 64 components e0 .. e0 + 63 (four vectors per query: up to 16 chains)."""
    dv = acc.shape[1]
    z = vzero()
    a0, a1, a2, a3 = (
        vload(acc, r0 * dv + e0),
        vload(acc, r0 * dv + e0 + LANES),
        vload(acc, r0 * dv + e0 + 2 * LANES),
        vload(acc, r0 * dv + e0 + 3 * LANES),
    )
    b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = z
    if n > 1:
        b0, b1, b2, b3 = (
            vload(acc, r1 * dv + e0),
            vload(acc, r1 * dv + e0 + LANES),
            vload(acc, r1 * dv + e0 + 2 * LANES),
            vload(acc, r1 * dv + e0 + 3 * LANES),
        )
    if n > 2:
        c0, c1, c2, c3 = (
            vload(acc, r2 * dv + e0),
            vload(acc, r2 * dv + e0 + LANES),
            vload(acc, r2 * dv + e0 + 2 * LANES),
            vload(acc, r2 * dv + e0 + 3 * LANES),
        )
    if n > 3:
        d0, d1, d2, d3 = (
            vload(acc, r3 * dv + e0),
            vload(acc, r3 * dv + e0 + LANES),
            vload(acc, r3 * dv + e0 + 2 * LANES),
            vload(acc, r3 * dv + e0 + 3 * LANES),
        )
    for j in range(KT):
        o = j * dv + e0
        v0, v1, v2, v3 = vload(vt, o), vload(vt, o + LANES), vload(vt, o + 2 * LANES), vload(vt, o + 3 * LANES)
        p = vbcast(sc[s0 + j])
        a0, a1, a2, a3 = vfma(p, v0, a0), vfma(p, v1, a1), vfma(p, v2, a2), vfma(p, v3, a3)
        if n > 1:
            p = vbcast(sc[s1 + j])
            b0, b1, b2, b3 = vfma(p, v0, b0), vfma(p, v1, b1), vfma(p, v2, b2), vfma(p, v3, b3)
        if n > 2:
            p = vbcast(sc[s2 + j])
            c0, c1, c2, c3 = vfma(p, v0, c0), vfma(p, v1, c1), vfma(p, v2, c2), vfma(p, v3, c3)
        if n > 3:
            p = vbcast(sc[s3 + j])
            d0, d1, d2, d3 = vfma(p, v0, d0), vfma(p, v1, d1), vfma(p, v2, d2), vfma(p, v3, d3)
    for q in range(n):
        r = r0 if q == 0 else (r1 if q == 1 else (r2 if q == 2 else r3))
        x0, x1, x2, x3 = (
            (a0, a1, a2, a3)
            if q == 0
            else ((b0, b1, b2, b3) if q == 1 else ((c0, c1, c2, c3) if q == 2 else (d0, d1, d2, d3)))
        )
        vstore(acc, r * dv + e0, x0)
        vstore(acc, r * dv + e0 + LANES, x1)
        vstore(acc, r * dv + e0 + 2 * LANES, x2)
        vstore(acc, r * dv + e0 + 3 * LANES, x3)


@njit(cache=True, forceinline=True, _nrt=False)
def tile_pv(n, sc, s0, s1, s2, s3, vt, acc, r0, r1, r2, r3):
    """P·V of n <= 4 queries at once, none with a p = 0 in the tile: query i's probabilities at
    sc[s_i:s_i + KT], its state row r_i of acc [rows, dv]. Each V vector loaded feeds all n
    queries' chains; each chain is the one tile_pv1 runs for its query (cells in order), so
    the bits do not depend on n or on which queries share the pass."""
    dv = acc.shape[1]
    e0 = np.int64(0)  # not a literal: _pv_block compiled once
    while e0 + 4 * LANES <= dv:
        _pv_block(n, sc, s0, s1, s2, s3, vt, acc, r0, r1, r2, r3, e0)
        e0 += 4 * LANES
    if e0 < dv:  # 16 to 48 components left: per query (the same chains)
        for q in range(n):
            r = r0 if q == 0 else (r1 if q == 1 else (r2 if q == 2 else r3))
            so = s0 if q == 0 else (s1 if q == 1 else (s2 if q == 2 else s3))
            _pv_rest(sc, so, vt, acc, r, e0)


@njit(cache=True, inline="always")
def _pv_rest(sc, so, vt, acc, r, e_lo):
    """tile_pv1 for the components e_lo .. dv of one query."""
    dv = acc.shape[1]
    o = r * dv
    for e0 in range(e_lo, dv, LANES):
        a = vload(acc, o + e0)
        for j in range(KT):
            p = sc[so + j]
            if p != 0.0:
                a = vfma(vbcast(p), vload(vt, j * dv + e0), a)
        vstore(acc, o + e0, a)


@njit(cache=True, forceinline=True, _nrt=False)
def prefetch_tile(raw, st, j0, b0, nb):
    """Ask for bytes [b0, b0 + nb) of cache rows j0 .. j0 + KT - 1 of stream st (those that
    exist) ahead of load_tile, one hint per 64-byte line: the rows of a kv head are strided,
    which the hardware prefetcher follows late, and a tile's arithmetic hides the wait."""
    for j in range(j0, min(j0 + KT, raw.shape[1])):
        o = st * raw.strides[0] + j * raw.strides[1] + b0  # flat byte index
        for b in range(0, nb, 64):
            prefetch(raw, o + b)
