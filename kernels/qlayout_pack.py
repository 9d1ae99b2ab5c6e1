"""The load-time repack of kernels/qlayout.py as one compiled pass per matrix slice.

Why: the layout used to be built with numpy — unpack every value, stack, transpose, pack nibbles
and bit planes, copy contiguous, interleave the scales — a dozen full passes and temporaries per
matrix: 0.6 s of a warm SmolLM2 start (half of its load) and ~10 MB of temporaries per slice.
Here each row's blocks are decoded into a 256-byte buffer and every byte is written once at its
interleaved home (module docstring of kernels/qlayout.py), so the pass is bound by reading the
file and writing the result. The bytes are the numpy version's, bit for bit
(tests/test_qlayout_pack.py compares every format against it).

``pack_rows(raw, t, layout, g0, q, d, mm, sc, mn)``: raw u8 [rows, row_bytes] (read-only, C order;
the slice's first row a multiple of R) of ggml type t -> row groups g0 .. g0 + ceil(rows / R) - 1
of the output arrays (q as u8 bytes; mm / sc / mn empty when the format has none). ``layout`` is
(values per sub-block, sub-blocks per block, bit planes, nibbles, block bytes), read by the caller
from qlayout.FORMATS and ggml_types.type_info so the two tables stay the only ones. Rows past the
slice's end are written as zeros. One specialization serves every format (t is a run-time int).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvchat.kernels.ggml_types import GGMLType

R = 32  # rows interleaved per group (kernels/qlayout.R)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = (
    int(GGMLType.Q4_0),
    int(GGMLType.Q4_1),
    int(GGMLType.Q5_0),
    int(GGMLType.Q5_1),
    int(GGMLType.Q8_0),
)
_IQ4_NL, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = (
    int(GGMLType.IQ4_NL),
    int(GGMLType.Q2_K),
    int(GGMLType.Q3_K),
    int(GGMLType.Q4_K),
    int(GGMLType.Q5_K),
    int(GGMLType.Q6_K),
)
_IQ4_NL_BYTES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8).view(
    np.uint8
)


@njit(cache=True, inline="always")
def _u16(b, i):
    return np.uint16(b[i]) | (np.uint16(b[i + 1]) << np.uint16(8))


@njit(cache=True)
def _decode(t, b, o, vals, scs, mns):
    """Block at b[o:] -> its values (vals u8 [sub-blocks * S], the file's integers moved to be
    unsigned as qlayout stores them, or the i8 bits of q8_0 / iq4_nl), K-quant sub-block scales
    and mins (scs, mns u8 [16]); returns the f16 bits (d, m) — m the offset / -dmin, else 0."""
    d = _u16(b, o)
    m = np.uint16(0)
    if t == _Q4_0 or t == _Q4_1 or t == _IQ4_NL:
        qo = o + 2 if t != _Q4_1 else o + 4
        if t == _Q4_1:
            m = _u16(b, o + 2)
        for j in range(16):
            x = b[qo + j]
            if t == _IQ4_NL:
                vals[j] = _IQ4_NL_BYTES[x & 15]
                vals[16 + j] = _IQ4_NL_BYTES[x >> 4]
            else:
                vals[j] = x & 15
                vals[16 + j] = x >> 4
    elif t == _Q5_0 or t == _Q5_1:
        ho = o + 2 if t == _Q5_0 else o + 4
        if t == _Q5_1:
            m = _u16(b, o + 2)
        qh = (
            np.uint32(b[ho]) | (np.uint32(b[ho + 1]) << 8) | (np.uint32(b[ho + 2]) << 16) | (np.uint32(b[ho + 3]) << 24)
        )
        for j in range(16):
            x = b[ho + 4 + j]
            vals[j] = (x & 15) | (((qh >> j) & 1) << 4)
            vals[16 + j] = (x >> 4) | (((qh >> (16 + j)) & 1) << 4)
    elif t == _Q8_0:
        for j in range(32):
            vals[j] = b[o + 2 + j]
    elif t == _Q4_K or t == _Q5_K:
        m = _u16(b, o + 2) ^ np.uint16(0x8000)  # -dmin, exact
        s = o + 4
        for j in range(4):
            scs[j] = b[s + j] & 63
            mns[j] = b[s + 4 + j] & 63
            scs[4 + j] = (b[s + 8 + j] & 15) | ((b[s + j] >> 6) << 4)
            mns[4 + j] = (b[s + 8 + j] >> 4) | ((b[s + 4 + j] >> 6) << 4)
        qo = o + 16 if t == _Q4_K else o + 48
        for c in range(4):
            for j in range(32):
                x = b[qo + 32 * c + j]
                lo = x & 15
                hi = x >> 4
                if t == _Q5_K:
                    h = b[o + 16 + j]
                    lo |= ((h >> (2 * c)) & 1) << 4
                    hi |= ((h >> (2 * c + 1)) & 1) << 4
                vals[64 * c + j] = lo
                vals[64 * c + 32 + j] = hi
    elif t == _Q6_K:
        d = _u16(b, o + 208)
        for j in range(16):
            scs[j] = b[o + 192 + j]
        for h in range(2):
            for j in range(32):
                a0 = b[o + 64 * h + j]
                a1 = b[o + 64 * h + 32 + j]
                qh = b[o + 128 + 32 * h + j]
                base = 128 * h + j
                vals[base] = (a0 & 15) | ((qh & 3) << 4)
                vals[base + 32] = (a1 & 15) | (((qh >> 2) & 3) << 4)
                vals[base + 64] = (a0 >> 4) | (((qh >> 4) & 3) << 4)
                vals[base + 96] = (a1 >> 4) | (((qh >> 6) & 3) << 4)
    elif t == _Q3_K:
        d = _u16(b, o + 108)
        s = o + 96
        for j in range(16):
            low = (b[s + j % 8] >> (4 * (j // 8))) & 15
            high = (b[s + 8 + j % 4] >> (2 * (j // 4))) & 3
            scs[j] = np.uint8((low | (high << 4)) - 32)  # i8 bits
        for h in range(2):
            for q in range(4):
                for j in range(32):
                    x = (b[o + 32 + 32 * h + j] >> (2 * q)) & 3
                    hb = (b[o + j] >> (4 * h + q)) & 1
                    vals[128 * h + 32 * q + j] = x + 4 * hb
    else:  # q2_K
        d = _u16(b, o + 80)
        m = _u16(b, o + 82) ^ np.uint16(0x8000)
        for j in range(16):
            scs[j] = b[o + j] & 15
            mns[j] = b[o + j] >> 4
        for h in range(2):
            for q in range(4):
                for j in range(32):
                    vals[128 * h + 32 * q + j] = (b[o + 16 + 32 * h + j] >> (2 * q)) & 3
    return d, m


@njit(cache=True, inline="always")
def _put_nibbles(dst, vals, base, half, r):
    """Sub-block values at vals[base:] -> row r's nibble bytes: low half | high half << 4."""
    for st in range(half // 4):
        o = (st * R + r) * 4
        for i in range(4):
            dst[o + i] = (vals[base + 4 * st + i] & 15) | ((vals[base + half + 4 * st + i] & 15) << 4)


@njit(cache=True, inline="always")
def _put_planes(dst, vals, base, half, r, planes, nib_bytes):
    """OR row r's bits above the nibble into the sub-block's high-bit bytes (kernels/qlayout.py).
    One plane: value i of step st is bit 4 (r % 16) + i of word r // 16 (low half) or 2 + r // 16
    (high half). Two (q6_K's crumbs): bits 4-5 of value i of step st are bits 2 v .. 2 v + 1 of
    byte 4 (r % 16) + i of the step's 64 bytes, v = r // 16 (low half) or 2 + r // 16 (high half)."""
    sh = 4 * (r % 2)
    for st in range(half // 4):
        if planes == 2:
            for i in range(4):
                b = nib_bytes + st * 64 + (r % 16) * 4 + i
                v = r // 16
                dst[b] |= ((vals[base + 4 * st + i] >> 4) & 3) << (2 * v)
                dst[b] |= ((vals[base + half + 4 * st + i] >> 4) & 3) << (2 * v + 4)
            continue
        lo = 0
        hi = 0
        for i in range(4):
            lo |= ((vals[base + 4 * st + i] >> 4) & 1) << i
            hi |= ((vals[base + half + 4 * st + i] >> 4) & 1) << i
        w = nib_bytes + (st * 4 + r // 16) * 8 + (r % 16) // 2
        dst[w] |= lo << sh
        dst[w + 16] |= hi << sh


@njit(cache=True, inline="always")
def _put_bytes(dst, vals, base, s_vals, r):
    for st in range(s_vals // 4):
        o = (st * R + r) * 4
        for i in range(4):
            dst[o + i] = vals[base + 4 * st + i]


@njit(cache=True)
def pack_rows(raw, t, layout, g0, q, d, mm, sc, mn):
    """Module docstring. raw u8 [rows, row_bytes]; q u8 [G, n_sub, sub-block bytes]; d, mm u16
    [G, n_super, R]; sc, mn i8 [G, n_sub, R] (mm, sc, mn may be empty).
    Serial: a model is repacked once (the result is cached, kvchat.runtime.weights), and a
    parallel kernel (a numba parfor) would cost a first run more compile time than it saves."""
    s_vals, subs, planes, nib, bsize = layout
    rows = raw.shape[0]
    n_blocks = raw.shape[1] // bsize
    half = s_vals // 2
    nib_bytes = half * R
    has_m, has_sc, has_mn = mm.shape[0] > 0, sc.shape[0] > 0, mn.shape[0] > 0
    copy_nib = t == _Q4_0 or t == _Q4_1  # the file's qs bytes are the nibble bytes already
    copy_bytes = t == _Q8_0
    copy_q5 = t == _Q5_0 or t == _Q5_1  # q4_0's nibble bytes + one plane straight from qh
    for gl in range((rows + R - 1) // R):
        g = g0 + gl
        vals = np.zeros(256, np.uint8)
        scs = np.zeros(16, np.uint8)
        mns = np.zeros(16, np.uint8)
        if planes:
            q[g, :, nib_bytes:] = 0  # bits are ORed in below
        for r in range(R):
            row = gl * R + r
            if row >= rows:  # padding rows: zero values, scales and offsets
                for bi in range(n_blocks):
                    d[g, bi, r] = 0
                    if has_m:
                        mm[g, bi, r] = 0
                for sb in range(n_blocks * subs):
                    if has_sc:
                        sc[g, sb, r] = 0
                    if has_mn:
                        mn[g, sb, r] = 0
                    dst = q[g, sb]
                    for st in range(nib_bytes // (R * 4) if nib else s_vals // 4):
                        o = (st * R + r) * 4
                        for i in range(4):
                            dst[o + i] = 0
                continue
            b = raw[row]
            for bi in range(n_blocks):
                o = bi * bsize
                if copy_nib or copy_bytes:
                    d[g, bi, r] = _u16(b, o)
                    qo = o + 2
                    if t == _Q4_1:
                        mm[g, bi, r] = _u16(b, o + 2)
                        qo = o + 4
                    dst = q[g, bi]
                    for st in range(4 if copy_nib else 8):
                        od = (st * R + r) * 4
                        for i in range(4):
                            dst[od + i] = b[qo + 4 * st + i]
                    continue
                if copy_q5:
                    d[g, bi, r] = _u16(b, o)
                    ho = o + 2
                    if t == _Q5_1:
                        mm[g, bi, r] = _u16(b, o + 2)
                        ho = o + 4
                    qh = (
                        np.uint32(b[ho])
                        | (np.uint32(b[ho + 1]) << 8)
                        | (np.uint32(b[ho + 2]) << 16)
                        | (np.uint32(b[ho + 3]) << 24)
                    )
                    dst = q[g, bi]
                    sh = 4 * (r % 2)
                    for st in range(4):
                        od = (st * R + r) * 4
                        for i in range(4):
                            dst[od + i] = b[ho + 4 + 4 * st + i]
                        w = nib_bytes + (st * 4 + r // 16) * 8 + (r % 16) // 2  # plane 0 (module docstring)
                        dst[w] |= ((qh >> (4 * st)) & 15) << sh
                        dst[w + 16] |= ((qh >> (16 + 4 * st)) & 15) << sh
                    continue
                dv, mv = _decode(t, b, o, vals, scs, mns)
                d[g, bi, r] = dv
                if has_m:
                    mm[g, bi, r] = mv
                for ls in range(subs):
                    sb = bi * subs + ls
                    if has_sc:
                        sc[g, sb, r] = np.int8(scs[ls])
                    if has_mn:
                        mn[g, sb, r] = np.int8(mns[ls])
                    dst = q[g, sb]
                    if nib:
                        _put_nibbles(dst, vals, ls * s_vals, half, r)
                        if planes:
                            _put_planes(dst, vals, ls * s_vals, half, r, planes, nib_bytes)
                    else:
                        _put_bytes(dst, vals, ls * s_vals, s_vals, r)
