"""The k-quants: 256-value super-blocks q2_K, q3_K, q4_K, q5_K, q6_K (and q8_K), dequantize only.

These are weight formats (the models ship them); the KV cache never holds them, so only
decoding is needed. Super-block layouts (little-endian, ggml-common.h):
  q2_K  scales[16] (lo nibble scale, hi nibble min) | qs[64] 2-bit | half d | half dmin
        16 groups of 16: x = d*sc*q - dmin*m
  q3_K  hmask[32] | qs[64] 2-bit | scales[12] (16 x 6-bit, packed) | half d
        16 groups of 16: x = d*(sc-32)*(q - (hbit ? 0 : 4))
  q4_K  half d | half dmin | scales[12] (8 x 6-bit scale + 8 x 6-bit min) | qs[128]
        8 groups of 32: x = d*sc*q - dmin*m
  q5_K  half d | half dmin | scales[12] | qh[32] | qs[128]   as q4_K with a 5th bit
  q6_K  ql[128] | qh[64] | scales[16] int8 | half d
        16 groups of 16: x = d*sc*(q - 32)
  q8_K  f32 d | qs[256] int8 | bsums[16] int16              x = d*q
Dequantizers use fastmath (1 ulp at most from the plain formula).
"""

import numpy as np
from numba import njit

from .quants_fp import read_f16, read_f32

QK_K = 256


@njit(cache=True)
def _scale_min_k4(j, sc):
    """Group j's 6-bit (scale, min) from the 12 packed bytes sc[0:12] of q4_K / q5_K."""
    if j < 4:
        return np.int64(sc[j]) & 63, np.int64(sc[j + 4]) & 63
    s = (np.int64(sc[j + 4]) & 0xF) | ((np.int64(sc[j - 4]) >> 6) << 4)
    m = (np.int64(sc[j + 4]) >> 4) | ((np.int64(sc[j]) >> 6) << 4)
    return s, m


@njit(cache=True, fastmath=True)
def dequant_row_q2_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 84] u8, dst [n] f32
        o = b * 84
        d = read_f16(src, o + 80)
        dmin = read_f16(src, o + 82)
        y = b * QK_K
        for half in range(2):  # 128 values per 32 bytes of qs
            q0 = o + 16 + 32 * half
            for shift_i in range(4):
                shift = 2 * shift_i
                for g in range(2):  # groups of 16 over qs[0:16] and qs[16:32]
                    sc = np.int64(src[o + 8 * half + 2 * shift_i + g])
                    dl = d * np.float32(sc & 0xF)
                    ml = dmin * np.float32(sc >> 4)
                    for l in range(16):
                        q = (np.int64(src[q0 + 16 * g + l]) >> shift) & 3
                        dst[y] = dl * np.float32(q) - ml
                        y += 1


@njit(cache=True)
def _q3k_scale(sc, j):
    """Group j's signed scale (6-bit value - 32) from the 12 packed bytes sc[0:12] of q3_K."""
    if j < 8:
        lo = np.int64(sc[j]) & 0xF
    else:
        lo = np.int64(sc[j - 8]) >> 4
    hi = (np.int64(sc[8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, fastmath=True)
def dequant_row_q3_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 110] u8, dst [n] f32
        o = b * 110
        d = read_f16(src, o + 108)
        sc = src[o + 96 : o + 108]
        y = b * QK_K
        j = 0
        for half in range(2):
            q0 = o + 32 + 32 * half
            for shift_i in range(4):
                shift = 2 * shift_i
                mbit = 1 << (4 * half + shift_i)
                for g in range(2):
                    dl = d * np.float32(_q3k_scale(sc, j))
                    j += 1
                    for l in range(16):
                        q = (np.int64(src[q0 + 16 * g + l]) >> shift) & 3
                        if (np.int64(src[o + 16 * g + l]) & mbit) == 0:
                            q -= 4
                        dst[y] = dl * np.float32(q)
                        y += 1


@njit(cache=True, fastmath=True)
def dequant_row_q4_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 144] u8, dst [n] f32
        o = b * 144
        d = read_f16(src, o)
        dmin = read_f16(src, o + 2)
        sc = src[o + 4 : o + 16]
        for c in range(4):  # 64 values per 32 bytes of qs: low nibbles, then high
            s1, m1 = _scale_min_k4(2 * c, sc)
            s2, m2 = _scale_min_k4(2 * c + 1, sc)
            d1 = d * np.float32(s1)
            n1 = dmin * np.float32(m1)
            d2 = d * np.float32(s2)
            n2 = dmin * np.float32(m2)
            y = b * QK_K + 64 * c
            q0 = o + 16 + 32 * c
            for l in range(32):
                q = np.int64(src[q0 + l])
                dst[y + l] = d1 * np.float32(q & 0xF) - n1
                dst[y + 32 + l] = d2 * np.float32(q >> 4) - n2


@njit(cache=True, fastmath=True)
def dequant_row_q5_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 176] u8, dst [n] f32
        o = b * 176
        d = read_f16(src, o)
        dmin = read_f16(src, o + 2)
        sc = src[o + 4 : o + 16]
        for c in range(4):
            s1, m1 = _scale_min_k4(2 * c, sc)
            s2, m2 = _scale_min_k4(2 * c + 1, sc)
            d1 = d * np.float32(s1)
            n1 = dmin * np.float32(m1)
            d2 = d * np.float32(s2)
            n2 = dmin * np.float32(m2)
            y = b * QK_K + 64 * c
            q0 = o + 48 + 32 * c
            for l in range(32):
                q = np.int64(src[q0 + l])
                h = np.int64(src[o + 16 + l]) >> (2 * c)
                dst[y + l] = d1 * np.float32((q & 0xF) | ((h & 1) << 4)) - n1
                dst[y + 32 + l] = d2 * np.float32((q >> 4) | ((h & 2) << 3)) - n2


@njit(cache=True, fastmath=True)
def dequant_row_q6_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 210] u8, dst [n] f32
        o = b * 210
        d = read_f16(src, o + 208)
        for half in range(2):  # 128 values from ql[64], qh[32], scales[8]
            ql = o + 64 * half
            qh = o + 128 + 32 * half
            s0 = o + 192 + 8 * half
            y = b * QK_K + 128 * half
            for l in range(32):
                g = l // 16
                h = np.int64(src[qh + l])
                a = np.int64(src[ql + l])
                c = np.int64(src[ql + 32 + l])
                q1 = ((a & 0xF) | ((h & 3) << 4)) - 32
                q2 = ((c & 0xF) | (((h >> 2) & 3) << 4)) - 32
                q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                q4 = ((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                dst[y + l] = d * np.float32(np.int8(src[s0 + g])) * np.float32(q1)
                dst[y + 32 + l] = d * np.float32(np.int8(src[s0 + g + 2])) * np.float32(q2)
                dst[y + 64 + l] = d * np.float32(np.int8(src[s0 + g + 4])) * np.float32(q3)
                dst[y + 96 + l] = d * np.float32(np.int8(src[s0 + g + 6])) * np.float32(q4)


@njit(cache=True, fastmath=True)
def dequant_row_q8_K(src, dst):
    for b in range(dst.shape[0] // QK_K):  # src [n/256 * 292] u8, dst [n] f32
        o = b * 292
        d = read_f32(src, o)
        for j in range(QK_K):
            dst[b * QK_K + j] = d * np.float32(np.int8(src[o + 4 + j]))
