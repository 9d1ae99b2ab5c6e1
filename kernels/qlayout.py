"""Load-time repack of ggml weight blocks into the layout of the integer kernel (kernels/matmul_int.py).

Why this layout: a matrix-vector product runs fastest here with the SIMD lanes over *rows*:
one ``vpdpbusd`` multiplies 16 rows x 4 consecutive values by 4 activation bytes broadcast to
every lane, so no horizontal sum is needed, every weight byte is loaded once per token, and the
activation is one 32-bit broadcast. So R = 32 rows are interleaved per group, 4 values per row
side by side:

    q  u8 / i8 [G, n_sub, sub-block bytes], each 32-row sub-block stored as
       bytes (q8_0, iq4_nl: signed): [S / 4 steps, R, 4], one byte per value;
       nibbles (every other format): [S / 8 steps, R, 4] bytes, byte i of step s holding value
           4s + i in its low nibble and value S/2 + 4s + i in its high one; then, for the 5-bit
           formats (q5_0, q5_1, q5_K: 1 plane) and q6_K (2 planes), the bits above the nibble:
           [S / 8 steps, planes, 4 words, 8 bytes], word w of step s a little-endian u64 whose
           bit b is bit 4 + plane of the value in byte b of vector w (rows 0-15 low nibbles,
           rows 16-31 low, rows 0-15 high, rows 16-31 high). The kernel ORs a plane in with one
           masked byte move (kernels/simd_int.bplane), so a value costs its file's bits: q5_0 is
           held in 5 bits a value, q6_K in 6 (one byte each before: +45 % / +33 % over the file).
           q2_K and q3_K values (<= 7) fit a nibble.
    d, m  u16 [G, n_super, R]    f16 bit patterns from the file: the block scale, and the
                                 q4_1 / q5_1 offset or the K-quants' -dmin (m empty when unused)
    sc, mn  i8 [G, n_sub, R]     K-quants: each sub-block's integer scale and min (else empty)

with S the values per sub-block (32, or 16 for q2_K / q3_K / q6_K), n_sub = k / S and
n_super = k / 32 (legacy formats, one sub-block each) or k / 256 (K-quants). Values are the
file's integers (never re-quantized), moved so that they are unsigned (q4_0's q - 8 is stored
as q with offset 8, q6_K's q - 32 with offset 32 ...): ``QFormat.offset`` is subtracted as
offset * sum(x) per sub-block in the kernel, exactly. G = ceil(m / R); rows past m are zero.

``QFormat`` is the per-type description the kernel is specialised on (numba sees it as a type
whose fields are compile-time constants): values per sub-block, sub-blocks per scale, offset,
nibbles or bytes, signed bytes, which activation format (ggml's vec_dot_type: q8_0, q8_1 or
q8_K), which offset term (q8_1's s, or the K-quants' integer mins) and the bit planes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox

from kernels.ggml_types import GGMLType

R = 32  # rows interleaved per group: 2 x 16 i32 lanes
ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = 0, 1, 2  # activation formats (ggml's vec_dot_type of the weight)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


class QFormat(NamedTuple):
    """Compile-time description of one weight type for kernels/matmul_int.py."""

    name: str
    sub: int  # S, values per sub-block (one integer dot product)
    n_sub: int  # sub-blocks per float scale d (1: legacy blocks of 32; 8 or 16: K-quant super-blocks)
    offset: int  # subtracted from every stored value (q4_0: 8, q5_0: 16, q6_K: 32, q3_K: 4)
    nib: bool  # two values per byte
    signed: bool  # i8 values (q8_0, iq4_nl); else unsigned values <= 63
    act: int  # ACT_Q8_0 / ACT_Q8_1 / ACT_Q8_K
    lmin: bool  # + m * s (q4_1, q5_1 with q8_1's s = d * sum(q))
    kmin: bool  # + (-dmin) * dx * sum_j mn_j * sum(x of sub-block j) (q4_K, q5_K, q2_K)
    planes: int = 0  # bit planes above the nibble: 1 for the 5-bit formats, 2 for q6_K

    @property
    def super_values(self) -> int:
        return self.sub * self.n_sub

    @property
    def _numba_type_(self):
        """numba's dispatcher reads this instead of calling typeof (13 µs -> 0.6 µs a call)."""
        t = _NUMBA_TYPES.get(self)
        if t is None:
            t = _NUMBA_TYPES[self] = QFormatType(self)
        return t


_NUMBA_TYPES: dict = {}


FORMATS = {
    GGMLType.Q4_0: QFormat("q4_0", 32, 1, 8, True, False, ACT_Q8_0, False, False),
    GGMLType.Q4_1: QFormat("q4_1", 32, 1, 0, True, False, ACT_Q8_1, True, False),
    GGMLType.Q5_0: QFormat("q5_0", 32, 1, 16, True, False, ACT_Q8_0, False, False, 1),
    GGMLType.Q5_1: QFormat("q5_1", 32, 1, 0, True, False, ACT_Q8_1, True, False, 1),
    GGMLType.Q8_0: QFormat("q8_0", 32, 1, 0, False, True, ACT_Q8_0, False, False),
    GGMLType.IQ4_NL: QFormat("iq4_nl", 32, 1, 0, False, True, ACT_Q8_0, False, False),
    GGMLType.Q2_K: QFormat("q2_K", 16, 16, 0, True, False, ACT_Q8_K, False, True),
    GGMLType.Q3_K: QFormat("q3_K", 16, 16, 4, True, False, ACT_Q8_K, False, False),
    GGMLType.Q4_K: QFormat("q4_K", 32, 8, 0, True, False, ACT_Q8_K, False, True),
    GGMLType.Q5_K: QFormat("q5_K", 32, 8, 0, True, False, ACT_Q8_K, False, True, 1),
    GGMLType.Q6_K: QFormat("q6_K", 16, 16, 32, True, False, ACT_Q8_K, False, False, 2),
}


class QFormatType(types.Dummy):
    """numba type of a QFormat: its fields are read at compile time (kernels/matmul_int.fmt_*)."""

    def __init__(self, fmt: QFormat):
        self.fmt = QFormat(*fmt)
        super().__init__(name="qfmt(" + ",".join(str(v) for v in self.fmt) + ")")

    @property
    def key(self):
        return self.fmt


@typeof_impl.register(QFormat)
def _typeof_qformat(val, c):
    return QFormatType(val)


register_model(QFormatType)(models.OpaqueModel)


@unbox(QFormatType)
def _unbox_qformat(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


# ---- repack ---------------------------------------------------------------------------------

def _f16_bits(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) -> the u16 f16 bit pattern."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _interleave_rows(a: np.ndarray, m: int) -> np.ndarray:
    """[m, ...rest] -> [G, ...rest, R] (rows padded with zeros to G * R)."""
    g = -(-m // R)
    pad = np.zeros((g * R,) + a.shape[1:], a.dtype)
    pad[:m] = a
    return np.ascontiguousarray(np.moveaxis(pad.reshape((g, R) + a.shape[1:]), 1, -1))


def _pack_values(v: np.ndarray, m: int, fmt: QFormat) -> np.ndarray:
    """values [m, n_sub, S] (u8 or i8) -> q [G, n_sub, sub-block bytes] (module docstring)."""
    n_sub, s = v.shape[1], v.shape[2]
    g = -(-m // R)

    def interleave(a):  # [m, n_sub, steps, 4] -> [G, n_sub, steps, R, 4], rows past m zero
        pad = np.zeros((g * R,) + a.shape[1:], a.dtype)
        pad[:m] = a
        return pad.reshape((g, R) + a.shape[1:]).transpose(0, 2, 3, 1, 4)

    if not fmt.nib:
        return np.ascontiguousarray(interleave(v.reshape(m, n_sub, s // 4, 4)).reshape(g, n_sub, s * R))
    half = s // 2
    lo, hi = v[..., :half], v[..., half:]
    nib = interleave(((lo & 15) | ((hi & 15) << 4)).astype(np.uint8).reshape(m, n_sub, half // 4, 4))
    parts = [nib.reshape(g, n_sub, half * R)]
    if fmt.planes:
        words = []  # [G, n_sub, steps, planes, 4 words (low 0-15, low 16-31, high 0-15, high 16-31), 64 bits]
        for p in range(fmt.planes):
            bl = interleave(((lo >> (4 + p)) & 1).astype(np.uint8).reshape(m, n_sub, half // 4, 4))
            bh = interleave(((hi >> (4 + p)) & 1).astype(np.uint8).reshape(m, n_sub, half // 4, 4))
            steps = half // 4
            bl = bl.reshape(g, n_sub, steps, 2, 64)  # rows 0-15, 16-31: byte 4 r + i of the vector
            bh = bh.reshape(g, n_sub, steps, 2, 64)
            words.append(np.concatenate([bl, bh], 3))
        bits = np.stack(words, 3)  # [G, n_sub, steps, planes, 4, 64]
        parts.append(np.packbits(bits, axis=-1, bitorder="little").reshape(g, n_sub, -1))
    return np.ascontiguousarray(np.concatenate(parts, -1)) if len(parts) > 1 else np.ascontiguousarray(parts[0])


def _bits(x: np.ndarray, n: int) -> np.ndarray:
    """u32 [...] -> u8 [..., n]: bit i of each word."""
    return ((x[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _k4_scales(s: np.ndarray):
    """12 packed bytes of q4_K / q5_K -> (scales, mins) u8 [..., 8], 6 bits each."""
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_mn, hi_mn], -1)


def _q3k_scales(sc: np.ndarray) -> np.ndarray:
    """12 packed bytes of q3_K -> signed scales i8 [..., 16] (6 bits, minus 32)."""
    s = sc.astype(np.int32)
    out = np.empty(sc.shape[:-1] + (16,), np.int8)
    for j in range(16):
        low = (s[..., j % 8] >> (4 * (j // 8))) & 15
        high = (s[..., 8 + j % 4] >> (2 * (j // 4))) & 3
        out[..., j] = (low | (high << 4)) - 32
    return out


EMPTY_U16 = np.zeros((0, 0, 0), np.uint16)
EMPTY_I8 = np.zeros((0, 0, 0), np.int8)


class Packed(NamedTuple):
    q: np.ndarray  # u8 / i8 [G, n_sub, sub-block bytes]
    d: np.ndarray  # u16 [G, n_super, R]
    m: np.ndarray  # u16 [G, n_super, R] or empty
    sc: np.ndarray  # i8 [G, n_sub, R] or empty
    mn: np.ndarray  # i8 [G, n_sub, R] or empty


REPACK_ROWS = 8192  # rows repacked at a time (a multiple of R): bounds the temporaries to ~10 MB


def repack_int(raw: np.ndarray, t: int, k: int, done=None) -> tuple[QFormat, Packed]:
    """raw u8 [m, row_bytes] of block type t -> (its QFormat, the packed arrays).

    Rows are repacked REPACK_ROWS at a time into the preallocated result, so a 170 MB output
    matrix never has several full-size temporaries; ``done(rows)`` is called after each slice
    of raw has been read (the caller releases those file pages, kernels/matmul.py)."""
    t = GGMLType(t)
    fmt = FORMATS.get(t)
    if fmt is None:
        raise ValueError(f"matmul: ggml type {t.name} is not supported for weights")
    m = raw.shape[0]
    if m <= REPACK_ROWS:
        out = _repack_rows(raw, t, k, fmt)
        if done is not None:
            done(raw)
        return fmt, out
    parts = None
    for r0 in range(0, m, REPACK_ROWS):
        r1 = min(m, r0 + REPACK_ROWS)
        p = _repack_rows(raw[r0:r1], t, k, fmt)
        if parts is None:  # [G, ...] arrays of the whole matrix, filled slice by slice
            g = -(-m // R)
            parts = [a if a.size == 0 else np.empty((g,) + a.shape[1:], a.dtype) for a in p]
        for whole, a in zip(parts, p):
            if a.size:
                whole[r0 // R:r0 // R + a.shape[0]] = a
        if done is not None:
            done(raw[r0:r1])
    return fmt, Packed(*parts)


def _repack_rows(raw: np.ndarray, t: GGMLType, k: int, fmt: QFormat) -> Packed:
    """repack_int on a slice of rows (its start a multiple of R)."""
    m = raw.shape[0]
    if fmt.n_sub == 1:  # legacy 32-value blocks
        nb = k // 32
        blk = raw.reshape(m, nb, raw.shape[1] // nb)
        bsz = blk.shape[2]
        d = _f16_bits(blk[..., 0:2])
        mm = _f16_bits(blk[..., 2:4]) if fmt.lmin else None
        if t in (GGMLType.Q4_0, GGMLType.Q4_1):
            qs = blk[..., bsz - 16:]
            v = np.concatenate([qs & 15, qs >> 4], -1)
        elif t == GGMLType.Q8_0:
            v = blk[..., 2:].view(np.int8)
        elif t == GGMLType.IQ4_NL:
            qs = blk[..., 2:]
            v = IQ4_NL_VALUES[np.concatenate([qs & 15, qs >> 4], -1)]
        else:  # q5_0, q5_1: nibble plus a fifth bit from the 32-bit qh word
            off = 2 if t == GGMLType.Q5_0 else 4
            qh = _bits(np.ascontiguousarray(blk[..., off:off + 4]).view("<u4")[..., 0], 32)
            qs = blk[..., off + 4:]
            v = (np.concatenate([qs & 15, qs >> 4], -1) | (qh << 4)).astype(np.uint8)
        q = _pack_values(np.ascontiguousarray(v), m, fmt)
        return Packed(q, _interleave_rows(d, m), EMPTY_U16 if mm is None else _interleave_rows(mm, m),
                      EMPTY_I8, EMPTY_I8)

    nsb = k // 256
    blk = raw.reshape(m, nsb, raw.shape[1] // nsb)
    sc = mn = None
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16_bits(blk[..., 0:2]), _f16_bits(blk[..., 2:4])
        sc, mn = _k4_scales(blk[..., 4:16])  # [m, nsb, 8]
        qs = blk[..., -128:].reshape(m, nsb, 4, 32)  # 4 chunks of 64 values: low nibbles, high nibbles
        v = np.stack([qs & 15, qs >> 4], 3)  # [m, nsb, 4, 2, 32]: sub-blocks 2c, 2c + 1
        if t == GGMLType.Q5_K:
            qh = blk[..., 16:48]  # [m, nsb, 32]: bit 2c / 2c + 1 -> chunk c low / high
            hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            v = v + (hb.reshape(m, nsb, 4, 2, 32) << 4)
        v = v.reshape(m, nsb * 8, 32).astype(np.uint8)
    elif t == GGMLType.Q6_K:
        ql, qh = blk[..., 0:128].reshape(m, nsb, 2, 64), blk[..., 128:192].reshape(m, nsb, 2, 32)
        sc = blk[..., 192:208].view(np.int8)
        d = _f16_bits(blk[..., 208:210])
        dmin = None
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)
        v = (lo | (hi << 4)).astype(np.uint8).reshape(m, nsb * 16, 16)  # q - 32 stored as q
    elif t == GGMLType.Q3_K:
        hm, qs = blk[..., 0:32], blk[..., 32:96].reshape(m, nsb, 2, 32)
        sc = _q3k_scales(blk[..., 96:108])
        d = _f16_bits(blk[..., 108:110])
        dmin = None
        low = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], 3)  # [m, nsb, 2, 4, 32]
        hbit = ((hm[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1)
        v = (low + 4 * hbit.reshape(m, nsb, 2, 4, 32)).astype(np.uint8).reshape(m, nsb * 16, 16)  # q + 4
    else:  # q2_K
        scb, qs = blk[..., 0:16], blk[..., 16:80].reshape(m, nsb, 2, 32)
        d, dmin = _f16_bits(blk[..., 80:82]), _f16_bits(blk[..., 82:84])
        sc, mn = scb & 15, scb >> 4
        v = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], 3).astype(np.uint8).reshape(m, nsb * 16, 16)
    q = _pack_values(np.ascontiguousarray(v), m, fmt)
    n_sub = k // fmt.sub
    neg_dmin = EMPTY_U16 if dmin is None else _interleave_rows(dmin ^ np.uint16(0x8000), m)  # -dmin, exact
    return Packed(q, _interleave_rows(d, m), neg_dmin,
                  _interleave_rows(sc.reshape(m, n_sub).astype(np.int8), m),
                  EMPTY_I8 if mn is None else _interleave_rows(mn.reshape(m, n_sub).astype(np.int8), m))
