"""The 32-value block formats: q4_0, q4_1, q5_0, q5_1, q8_0, q8_1 and iq4_nl.

Block layouts (little-endian, as ggml-common.h):
  q4_0   half d | 16 B nibbles                  x = d * (q - 8)
  q4_1   half d, half m | 16 B nibbles          x = d * q + m
  q5_0   half d | u32 high bits | 16 B nibbles  x = d * (q - 16)
  q5_1   half d, half m | u32 qh | 16 B         x = d * q + m
  q8_0   half d | 32 int8                       x = d * q
  q8_1   half d, half s | 32 int8               x = d * q   (s = d * sum q, for dot products)
  iq4_nl half d | 16 B nibbles                  x = d * KVALUES_IQ4NL[q]
  mxfp4  u8 e | 16 B nibbles                    x = 2^(e-128) * KVALUES_MXFP4[q]  (e2m1 doubled, e8m0 halved)
Nibble j of byte j holds value j, the high nibble holds value j + 16.

Quantizers reproduce ggml's reference ones (quantize_row_*_ref) bit for bit: every float op
is float32 in the reference's order, and they are compiled WITHOUT fastmath because fastmath
lets LLVM fuse multiply-adds and reassociate sums (iq4_nl), which changes the rounding of
values sitting on a quantization boundary. Dequantizers use fastmath: at most 1 ulp apart
from the plain formula (a fused x*d + m), and they run inside attention loops.
"""

import numpy as np
from numba import njit

from .quants_fp import read_f16, write_f16

QK = 32
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# ggml's kvalues_mxfp4: the e2m1 values times 2 (0, ±0.5 ... ±6 -> 0, ±1 ... ±12), so that a block's
# scale is GGML_E8M0_TO_FP32_HALF(e) = 2^(e - 128) and its dot product an integer one (kernels/qlayout.py)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_half_table() -> np.ndarray:
    """f32 [256]: GGML_E8M0_TO_FP32_HALF(e) = 2^(e - 128) for every exponent byte, as ggml builds its bits
    (2^-128 and 2^-127 as denormals)."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


E8M0_HALF = e8m0_half_table()
_F32_MAX = np.float32(3.4028234663852886e38)
_IQ4NL_EPS = np.float32(1e-15)  # below this block amax ggml stores a zero scale


# ---- helpers -------------------------------------------------------------------------------


@njit(cache=True)
def _absmax_signed(src, o):
    """The value of largest magnitude in src[o:o+32] (the first one on ties), float32."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(QK):
        v = src[o + j]
        if amax < abs(v):
            amax = abs(v)
            vmax = v
    return vmax


@njit(cache=True)
def _min_max(src, o):
    lo = _F32_MAX
    hi = -_F32_MAX
    for j in range(QK):
        v = src[o + j]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


@njit(cache=True)
def _recip(d):
    """1/d, or 0 for d == 0 (float32)."""
    return np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)


@njit(cache=True)
def _roundf(x):
    """C roundf (halves away from zero) of a float32, as an int; exact via float64."""
    r = np.floor(np.float64(abs(x)) + 0.5)
    return np.int64(r) if x >= 0 else -np.int64(r)


@njit(cache=True)
def _read_u32(src, o):
    return np.int64(src[o]) | (np.int64(src[o + 1]) << 8) | (np.int64(src[o + 2]) << 16) | (np.int64(src[o + 3]) << 24)


@njit(cache=True)
def _write_u32(dst, o, v):
    for k in range(4):
        dst[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


# ---- q4_0 ----------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_q4_0(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 18] u8, dst [n] f32
        o = b * 18
        d = read_f16(src, o)
        for j in range(16):
            q = np.int64(src[o + 2 + j])
            dst[b * QK + j] = np.float32((q & 0xF) - 8) * d
            dst[b * QK + j + 16] = np.float32((q >> 4) - 8) * d


@njit(cache=True)
def quant_row_q4_0(src, dst):
    for b in range(src.shape[0] // QK):
        o = b * 18
        d = _absmax_signed(src, b * QK) / np.float32(-8.0)
        idd = _recip(d)
        write_f16(dst, o, d)
        for j in range(16):
            q0 = min(15, np.int64(src[b * QK + j] * idd + np.float32(8.5)))
            q1 = min(15, np.int64(src[b * QK + j + 16] * idd + np.float32(8.5)))
            dst[o + 2 + j] = np.uint8(q0 | (q1 << 4))


# ---- q4_1 ----------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_q4_1(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 20] u8, dst [n] f32
        o = b * 20
        d = read_f16(src, o)
        m = read_f16(src, o + 2)
        for j in range(16):
            q = np.int64(src[o + 4 + j])
            dst[b * QK + j] = np.float32(q & 0xF) * d + m
            dst[b * QK + j + 16] = np.float32(q >> 4) * d + m


@njit(cache=True)
def quant_row_q4_1(src, dst):
    for b in range(src.shape[0] // QK):
        o = b * 20
        lo, hi = _min_max(src, b * QK)
        d = (hi - lo) / np.float32(15.0)
        idd = _recip(d)
        write_f16(dst, o, d)
        write_f16(dst, o + 2, lo)
        for j in range(16):
            q0 = min(15, np.int64((src[b * QK + j] - lo) * idd + np.float32(0.5)))
            q1 = min(15, np.int64((src[b * QK + j + 16] - lo) * idd + np.float32(0.5)))
            dst[o + 4 + j] = np.uint8(q0 | (q1 << 4))


# ---- q5_0 ----------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_q5_0(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 22] u8, dst [n] f32
        o = b * 22
        d = read_f16(src, o)
        qh = _read_u32(src, o + 2)
        for j in range(16):
            q = np.int64(src[o + 6 + j])
            q0 = (q & 0xF) | (((qh >> j) & 1) << 4)
            q1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[b * QK + j] = np.float32(q0 - 16) * d
            dst[b * QK + j + 16] = np.float32(q1 - 16) * d


@njit(cache=True)
def quant_row_q5_0(src, dst):
    for b in range(src.shape[0] // QK):
        o = b * 22
        d = _absmax_signed(src, b * QK) / np.float32(-16.0)
        idd = _recip(d)
        write_f16(dst, o, d)
        qh = np.int64(0)
        for j in range(16):
            q0 = min(31, np.int64(src[b * QK + j] * idd + np.float32(16.5)))
            q1 = min(31, np.int64(src[b * QK + j + 16] * idd + np.float32(16.5)))
            dst[o + 6 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
            qh |= ((q0 >> 4) & 1) << j
            qh |= ((q1 >> 4) & 1) << (j + 16)
        _write_u32(dst, o + 2, qh)


# ---- q5_1 ----------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_q5_1(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 24] u8, dst [n] f32
        o = b * 24
        d = read_f16(src, o)
        m = read_f16(src, o + 2)
        qh = _read_u32(src, o + 4)
        for j in range(16):
            q = np.int64(src[o + 8 + j])
            q0 = (q & 0xF) | (((qh >> j) & 1) << 4)
            q1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[b * QK + j] = np.float32(q0) * d + m
            dst[b * QK + j + 16] = np.float32(q1) * d + m


@njit(cache=True)
def quant_row_q5_1(src, dst):
    for b in range(src.shape[0] // QK):
        o = b * 24
        lo, hi = _min_max(src, b * QK)
        d = (hi - lo) / np.float32(31.0)
        idd = _recip(d)
        write_f16(dst, o, d)
        write_f16(dst, o + 2, lo)
        qh = np.int64(0)
        for j in range(16):
            # no clamp here, as in ggml: (x - min) * id + 0.5 stays below 32
            q0 = np.int64((src[b * QK + j] - lo) * idd + np.float32(0.5)) & 0xFF
            q1 = np.int64((src[b * QK + j + 16] - lo) * idd + np.float32(0.5)) & 0xFF
            dst[o + 8 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
            qh |= ((q0 >> 4) & 1) << j
            qh |= ((q1 >> 4) & 1) << (j + 16)
        _write_u32(dst, o + 4, qh)


# ---- q8_0 / q8_1 ---------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_q8_0(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 34] u8, dst [n] f32
        o = b * 34
        d = read_f16(src, o)
        for j in range(QK):
            dst[b * QK + j] = np.float32(np.int8(src[o + 2 + j])) * d


@njit(cache=True)
def _quant_block_q8(src, i0, dst, o):
    """Quantize src[i0:i0+32] to int8 at dst[o:o+32]; returns (d, sum of the int8 values)."""
    amax = np.float32(0.0)
    for j in range(QK):
        amax = max(amax, abs(src[i0 + j]))
    d = amax / np.float32(127.0)
    idd = _recip(d)
    s = np.int64(0)
    for j in range(QK):
        q = _roundf(src[i0 + j] * idd)
        s += q
        dst[o + j] = np.uint8(q & 0xFF)
    return d, s


@njit(cache=True)
def quant_row_q8_0(src, dst):
    for b in range(src.shape[0] // QK):
        d, _ = _quant_block_q8(src, b * QK, dst, b * 34 + 2)
        write_f16(dst, b * 34, d)


@njit(cache=True, fastmath=True)
def dequant_row_q8_1(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 36] u8, dst [n] f32
        o = b * 36
        d = read_f16(src, o)
        for j in range(QK):
            dst[b * QK + j] = np.float32(np.int8(src[o + 4 + j])) * d


@njit(cache=True)
def quant_row_q8_1(src, dst):
    for b in range(src.shape[0] // QK):
        d, s = _quant_block_q8(src, b * QK, dst, b * 36 + 4)
        write_f16(dst, b * 36, d)
        write_f16(dst, b * 36 + 2, np.float32(s) * d)


# ---- iq4_nl --------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_iq4_nl(src, dst):
    for b in range(dst.shape[0] // QK):  # src [n/32 * 18] u8, dst [n] f32
        o = b * 18
        d = read_f16(src, o)
        for j in range(16):
            q = np.int64(src[o + 2 + j])
            dst[b * QK + j] = d * np.float32(KVALUES_IQ4NL[q & 0xF])
            dst[b * QK + j + 16] = d * np.float32(KVALUES_IQ4NL[q >> 4])


@njit(cache=True)
def _iq4nl_index(x):
    """Index of the table value nearest to x (float32); the upper one on an exact tie."""
    if x <= np.float32(KVALUES_IQ4NL[0]):
        return 0
    if x >= np.float32(KVALUES_IQ4NL[15]):
        return 15
    lo = 0
    hi = 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < np.float32(KVALUES_IQ4NL[mid]):
            hi = mid
        else:
            lo = mid
    if x - np.float32(KVALUES_IQ4NL[hi - 1]) < np.float32(KVALUES_IQ4NL[hi]) - x:
        return hi - 1
    return hi


@njit(cache=True)
def quant_row_iq4_nl(src, dst):
    """ggml's quantize_row_iq4_nl_ref: scale from the extreme value, indices to the nearest
    table entry, then the least-squares scale (weights x^2) for those indices."""
    for b in range(src.shape[0] // QK):
        i0 = b * QK
        o = b * 18
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for j in range(QK):
            if abs(src[i0 + j]) > amax:
                amax = abs(src[i0 + j])
                vmax = src[i0 + j]
        if amax < _IQ4NL_EPS:
            # ggml leaves the indices of such a block unset (stale); with d = 0 any decode to 0
            write_f16(dst, o, np.float32(0.0))
            for j in range(16):
                dst[o + 2 + j] = np.uint8(0)
            continue
        d = vmax / np.float32(KVALUES_IQ4NL[0])
        idd = np.float32(1.0) / d
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for j in range(16):
            l0 = _iq4nl_index(idd * src[i0 + j])
            l1 = _iq4nl_index(idd * src[i0 + j + 16])
            dst[o + 2 + j] = np.uint8(l0 | (l1 << 4))
        for j in range(QK):  # accumulate in value order, as the reference does
            x = src[i0 + j]
            q = np.int64(dst[o + 2 + (j & 15)])
            q = (q & 0xF) if j < 16 else (q >> 4)
            qv = np.float32(KVALUES_IQ4NL[q])
            w = x * x
            sumqx += w * qv * x
            sumq2 += w * qv * qv
        d = sumqx / sumq2 if sumq2 > np.float32(0.0) else np.float32(0.0)
        write_f16(dst, o, d)


# ---- mxfp4 ---------------------------------------------------------------------------------


@njit(cache=True)
def dequant_row_mxfp4(src, dst):
    """ggml's dequantize_row_mxfp4: exact (a table integer times a power of two)."""
    for b in range(dst.shape[0] // QK):  # src [n/32 * 17] u8, dst [n] f32
        o = b * 17
        d = E8M0_HALF[src[o]]
        for j in range(16):
            q = np.int64(src[o + 1 + j])
            dst[b * QK + j] = np.float32(KVALUES_MXFP4[q & 0xF]) * d
            dst[b * QK + j + 16] = np.float32(KVALUES_MXFP4[q >> 4]) * d
