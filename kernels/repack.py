"""Load-time repack of ggml weight blocks into the row-interleaved layouts of kernels/matmul_kernels.py.

Why: a matrix-vector product is fastest here when the SIMD lanes run over *rows* (R = 32
output rows side by side): every weight byte is loaded once, the activation is a broadcast,
and no horizontal reduction is needed per 32-value block. So each format is rewritten, once,
into one of three kernel layouts — the values stay quantized, only their order and the
representation of the block scales change:

- ``nib``: 4-bit values 0..15, two per byte (byte j of a 32-block holds values j and j+16,
  ggml's q4_0 order), ``qs u8 [G, nb, 16, R]``; value = d * q + mn with per-32-block
  ``d, mn [G, nb, R]``.  q4_0 (mn = -8 d), q4_1, q4_K (sub-block scales resolved).
- ``i8``: one signed byte per value, ``q i8 [G, nb, B, R]`` with B = 32 or 16 values per
  scale; value = d * q + mn.  q8_0, q5_0, q5_1, q5_K, q6_K, q3_K, q2_K, iq4_nl (codebook
  values are int8). The symmetric formats (q8_0, q5_0, iq4_nl, q6_K, q3_K) have no offset:
  their ``mn`` is an empty [0, 0, 0] array, so no stream of zeros is read per token. The
  5/6/3/2-bit formats cost 8 bits a value here instead of 5.5-6.6: splitting their high bits
  in the inner loop costs more time than the memory is worth.
- ``f32``: ``w f32 [G, kp / 32, 32, R]`` for f32 / f16 / bf16 matrices (already float), k
  padded with zero columns to kp, a multiple of 32, so they run through the same block loop;
  ``d`` and ``mn`` are empty (no scale, no offset).

Scales and offsets are stored as f16 bit patterns (u16, 2 bytes instead of 4; the kernels
widen them exactly with one vcvtph2ps) whenever that is exact — always for the formats whose
scales are f16 in the file — else as f32 (the K-quants' d * sub-scale products).

G = ceil(m / R) row groups; the rows past m are zero (d = mn = 0) and never written out.
The kernels compute a block's share of a dot product as d * (q . x) + mn * sum(x), which
equals ggml's sum of (q - 8) * d * x etc. up to float rounding.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import GGMLType

R = 32  # rows interleaved per group: 32 f32 lanes = 4 AVX2 / 2 AVX-512 registers

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as float16 -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")[..., 0]


def _interleave(a: np.ndarray, m: int) -> np.ndarray:
    """[m, ...rest] -> [G, ...rest, R], rows padded with zeros to G * R. Built in slices of
    ROWS_PER_SLICE rows, so the scratch stays small beside the result (a whole-matrix pass held
    two padded copies: a 262144-row output head is 335 MB in f16)."""
    g = -(-m // R)
    rest = a.shape[1:]
    out = np.zeros((g,) + rest + (R,), a.dtype)
    step = ROWS_PER_SLICE // R
    for g0 in range(0, g, step):
        g1 = min(g, g0 + step)
        r0, r1 = g0 * R, min(m, g1 * R)
        blk = np.zeros(((g1 - g0) * R,) + rest, a.dtype)  # [rows, ...rest]
        blk[: r1 - r0] = a[r0:r1]
        out[g0:g1] = np.moveaxis(blk.reshape((g1 - g0, R) + rest), 1, -1)
    return out


ROWS_PER_SLICE = 8192


def _scales(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Interleaved block scales/offsets f32 [m, nb] -> [G, nb, R], stored as f16 bit patterns
    (u16, decoded in the kernel) when every value of every array is exactly an f16 — q4_0/1,
    q5_0/1, q8_0, iq4_nl always are — else as f32 (K-quant products d * sc rarely are). Both
    arrays of a pair get the same dtype, so each kernel has two specializations, not four.
    An array of size 0 stands for "no offset" and stays empty."""
    m = arrays[0].shape[0]
    with np.errstate(over="ignore"):  # an overflow to inf is caught by the exactness test below
        as_f16 = [a.astype(np.float16) for a in arrays]
    exact = all(np.array_equal(h.astype(np.float32), a) for h, a in zip(as_f16, arrays))
    if exact:
        return tuple(_interleave(h.view(np.uint16), m) for h in as_f16)
    return tuple(_interleave(a.astype(np.float32), m) for a in arrays)


def _no_offset(d: np.ndarray) -> np.ndarray:
    """The empty offset array of the symmetric formats, with the dtype of their scales."""
    return np.zeros((0, 0, 0), d.dtype)


def _nib_from_values(q: np.ndarray) -> np.ndarray:
    """values u8 [m, nb, 32] in 0..15 -> bytes [m, nb, 16]: low nibble value j, high value j+16."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _bits(x: np.ndarray, n: int) -> np.ndarray:
    """u32 [...] -> u8 [..., n]: bit i of each word."""
    return ((x[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _k4_scales(sc: np.ndarray):
    """12 packed bytes of q4_K / q5_K -> (scales, mins) u8 [..., 8], 6 bits each."""
    s = sc.astype(np.uint8)
    lo_sc = s[..., 0:4] & 63
    lo_mn = s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_mn, hi_mn], -1)


def _q3k_scales(sc: np.ndarray) -> np.ndarray:
    """12 packed bytes of q3_K -> signed scales i32 [..., 16] (6 bits, minus 32)."""
    s = sc.astype(np.int32)
    out = np.empty(sc.shape[:-1] + (16,), np.int32)
    for j in range(16):
        low = (s[..., j % 8] >> (4 * (j // 8))) & 15
        high = (s[..., 8 + j % 4] >> (2 * (j // 4))) & 3
        out[..., j] = (low | (high << 4)) - 32
    return out


def padded_k(t: int, k: int) -> int:
    """Row length the packed matrix of type t has: float rows are padded with zeros to whole
    32-value blocks (the caller pads x alike), block formats already are whole blocks."""
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return -(-k // 32) * 32
    return k


def repack(raw: np.ndarray, t: int, k: int) -> tuple[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """raw u8 [m, row_bytes] of type t -> (kind, (q, d, mn)) for kvchat.kernels.matmul_kernels.matmul_blocks."""
    m = raw.shape[0]
    t = GGMLType(t)
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        no_scale = np.zeros((0, 0, 0), np.float32)
        # f16 and bf16 stay in their own two bytes: the kernel widens them as it loads a vector
        # (simd.vload: u16 elements are f16 bit patterns, i16 elements bf16 ones)
        kind, dt = {GGMLType.F32: ("f32", np.float32), GGMLType.F16: ("f16", np.uint16)}.get(t, ("bf16", np.int16))
        w = raw.view(dt).reshape(m, k)
        kp = padded_k(t, k)
        if kp != k:  # zero columns to whole 32-blocks (the caller pads x alike)
            w = np.pad(w, ((0, 0), (0, kp - k)))
        return kind, (_interleave(w.reshape(m, kp // 32, 32), m), no_scale, no_scale)

    if t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.IQ4_NL):
        nb = k // 32
        bsz = raw.shape[1] // nb
        blk = raw.reshape(m, nb, bsz)
        d = _f16(blk[..., 0:2])
        if t in (GGMLType.Q4_0, GGMLType.Q4_1):
            mn = -8.0 * d if t == GGMLType.Q4_0 else _f16(blk[..., 2:4])
            qs = blk[..., bsz - 16 :]
            return "nib", (_interleave(qs, m), *_scales(d, mn.astype(np.float32)))
        if t == GGMLType.Q8_0:
            q = blk[..., 2:].view(np.int8)
            mn = None
        elif t == GGMLType.IQ4_NL:
            qs = blk[..., 2:]
            q = IQ4_NL_VALUES[np.concatenate([qs & 15, qs >> 4], -1)]
            mn = None
        else:  # q5_0, q5_1: nibble plus a fifth bit from the 32-bit qh word
            off = 2 if t == GGMLType.Q5_0 else 4
            qh = _bits(_u32(blk[..., off : off + 4]), 32)
            qs = blk[..., off + 4 :]
            q = np.concatenate([qs & 15, qs >> 4], -1) | (qh << 4)
            if t == GGMLType.Q5_0:
                q = q.astype(np.int8) - np.int8(16)
                mn = None
            else:
                mn = _f16(blk[..., 2:4])
            q = q.astype(np.int8)
        q = _interleave(np.ascontiguousarray(q), m)
        if mn is None:
            (dd,) = _scales(d)
            return "i8", (q, dd, _no_offset(dd))
        return "i8", (q, *_scales(d, mn))

    nsb = k // 256
    blk = raw.reshape(m, nsb, raw.shape[1] // nsb)
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mnq = _k4_scales(blk[..., 4:16])
        ds = (d[..., None] * sc).reshape(m, nsb * 8)  # [m, nb] per 32-value sub-block
        mn = -(dmin[..., None] * mnq).reshape(m, nsb * 8)
        qs = blk[..., -128:].reshape(m, nsb, 4, 32)  # 4 chunks of 64 values
        q = np.stack([qs & 15, qs >> 4], 3)  # [m, nsb, 4, 2, 32]: sub-block 2c, 2c+1
        if t == GGMLType.Q4_K:
            q = q.reshape(m, nsb * 8, 32)
            return "nib", (_interleave(_nib_from_values(q), m), *_scales(ds, mn))
        qh = blk[..., 16:48]  # [m, nsb, 32]: bit 2c / 2c+1 -> chunk c low / high
        hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        q = q + (hb.reshape(m, nsb, 4, 2, 32) << 4)
        q = q.reshape(m, nsb * 8, 32).astype(np.int8)
        return "i8", (_interleave(q, m), *_scales(ds, mn))

    if t == GGMLType.Q6_K:
        ql, qh = blk[..., 0:128].reshape(m, nsb, 2, 64), blk[..., 128:192].reshape(m, nsb, 2, 32)
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)  # [m, nsb, 16]
        d = _f16(blk[..., 208:210])
        # [m, nsb, 2 halves of 128, 4 quarters of 32, 32]
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        q = q.reshape(m, nsb * 16, 16)
        ds = (d[..., None] * sc).reshape(m, nsb * 16)
        (dd,) = _scales(ds)
        return "i8", (_interleave(q, m), dd, _no_offset(dd))

    if t == GGMLType.Q3_K:
        hm, qs = blk[..., 0:32], blk[..., 32:96].reshape(m, nsb, 2, 32)
        sc = _q3k_scales(blk[..., 96:108]).astype(np.float32)
        d = _f16(blk[..., 108:110])
        low = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], 3)  # [m, nsb, 2, 4, 32]
        hbit = (hm[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        hbit = hbit.reshape(m, nsb, 2, 4, 32)
        q = low.astype(np.int8) - (4 * (1 - hbit)).astype(np.int8)
        q = q.reshape(m, nsb * 16, 16)
        ds = (d[..., None] * sc).reshape(m, nsb * 16)
        (dd,) = _scales(ds)
        return "i8", (_interleave(q, m), dd, _no_offset(dd))

    if t == GGMLType.Q2_K:
        sc, qs = blk[..., 0:16], blk[..., 16:80].reshape(m, nsb, 2, 32)
        d, dmin = _f16(blk[..., 80:82]), _f16(blk[..., 82:84])
        q = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], 3).astype(np.int8)
        q = q.reshape(m, nsb * 16, 16)
        ds = (d[..., None] * (sc & 15)).reshape(m, nsb * 16)
        mn = -(dmin[..., None] * (sc >> 4)).reshape(m, nsb * 16)
        return "i8", (_interleave(q, m), *_scales(ds, mn))

    raise ValueError(f"matmul: ggml type {t.name} is not supported for weights")
