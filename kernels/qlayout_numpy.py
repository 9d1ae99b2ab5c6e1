"""The numpy build of kernels/qlayout.py's layout: the reference its compiled pass
(kernels/qlayout_pack.py) reproduces byte for byte (tests/test_qlayout_pack.py), and the repack
of a small model's first run.

It is the repack as it was written first: every value unpacked with numpy, stacked, transposed
and packed. Same arrays, same bytes; only slower (a dozen passes and temporaries per matrix:
Gemma-3-270M's 246 MB in 2.2 s CPU against 0.5 s compiled). The compiled pass costs ~6 s CPU
of numba compile the first time it runs, more than numpy takes for a model under
NUMPY_REPACK_BELOW bytes; a model's repack is cached (runtime/weights/cache.py), so
this path serves a first run only (model_repack() chooses, around a model's load).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from kvchat.kernels import qlayout
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.qlayout import EMPTY_I8, EMPTY_U16, FORMATS, IQ4_NL_VALUES, Packed, QFormat, R
from kvchat.kernels.repack import _bits, _k4_scales, _q3k_scales  # the block fields' decoding, shared


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
    if fmt.planes == 2:  # q6_K's crumbs: byte b of a step's 64 holds bits 4-5 of byte b of its 4 vectors
        steps = half // 4
        crumbs = [interleave(((x >> 4) & 3).astype(np.uint8).reshape(m, n_sub, steps, 4)) for x in (lo, hi)]
        vec = np.concatenate([c.reshape(g, n_sub, steps, 2, 64) for c in crumbs], 3)  # l0, l1, h0, h1
        packed = sum(vec[:, :, :, v].astype(np.uint8) << (2 * v) for v in range(4)).astype(np.uint8)
        parts.append(packed.reshape(g, n_sub, -1))
    elif fmt.planes:
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


def repack_reference(raw: np.ndarray, t: int, k: int) -> tuple[QFormat, Packed]:
    """raw u8 [m, row_bytes] of block type t -> (its QFormat, the packed arrays), all rows at once."""
    t = GGMLType(t)
    return FORMATS[t], _repack_rows(raw, t, k, FORMATS[t])


NUMPY_REPACK_BELOW = 768 << 20  # a model smaller than this repacks with numpy until pack_rows is compiled


@contextmanager
def model_repack(nbytes: int):
    """Around one model's load (nbytes: its file): its matrices repack with numpy (fill_rows,
    the same bytes) when the model is under NUMPY_REPACK_BELOW and numba holds no compiled
    pack_rows yet. Why: that compile costs ~6 s CPU, more than numpy's repack of a model that
    small (Gemma-3-270M: 2.2 s), and a model is repacked once (its pack is cached), so a first
    run would pay the compile for nothing; past the bound the compiled pass (4x faster) pays for
    its compile, and every later model then uses it."""
    before = qlayout._numpy_fill
    if nbytes < NUMPY_REPACK_BELOW and not _compiled_pack_ready():
        qlayout._numpy_fill = fill_rows
    try:
        yield
    finally:
        qlayout._numpy_fill = before


def _compiled_pack_ready() -> bool:
    """pack_rows compiled in this process or held by numba's cache for its one signature (or a
    compile plan's dry run, where calling it costs nothing)."""
    from kvchat.kernels.compile_plan import dry_running, ready
    from kvchat.kernels.qlayout_pack import pack_rows

    if dry_running() or pack_rows.signatures:
        return True
    u8, u16, i8 = (np.zeros((1, 1, 1), dt) for dt in (np.uint8, np.uint16, np.int8))
    raw = qlayout._read_only(np.zeros((1, 1), np.uint8))  # as repack_int passes model-file rows
    args = (raw, 0, (0, 0, 0, True, 0), 0, u8, u16, u16, i8, i8)
    return ready(pack_rows, args)


def fill_rows(raw: np.ndarray, t: int, k: int, g0: int, out: Packed) -> None:
    """pack_rows' job with numpy: raw u8 [rows, row_bytes] (a slice starting at row g0 * R) ->
    row groups g0 .. of out's arrays (rows past the slice's end zero)."""
    t = GGMLType(t)
    part = _repack_rows(raw, t, k, FORMATS[t])
    for dst, src in zip(out, part):
        if dst.size:
            dst[g0 : g0 + src.shape[0]] = src.view(dst.dtype)


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
            qs = blk[..., bsz - 16 :]
            v = np.concatenate([qs & 15, qs >> 4], -1)
        elif t == GGMLType.Q8_0:
            v = blk[..., 2:].view(np.int8)
        elif t == GGMLType.IQ4_NL:
            qs = blk[..., 2:]
            v = IQ4_NL_VALUES[np.concatenate([qs & 15, qs >> 4], -1)]
        elif t == GGMLType.MXFP4:  # the codes as nibbles (the kernel maps them); the exponent bytes as d
            qs = blk[..., 1:]
            v = np.concatenate([qs & 15, qs >> 4], -1)
            d = np.ascontiguousarray(blk[..., 0])
        else:  # q5_0, q5_1: nibble plus a fifth bit from the 32-bit qh word
            off = 2 if t == GGMLType.Q5_0 else 4
            qh = _bits(np.ascontiguousarray(blk[..., off : off + 4]).view("<u4")[..., 0], 32)
            qs = blk[..., off + 4 :]
            v = (np.concatenate([qs & 15, qs >> 4], -1) | (qh << 4)).astype(np.uint8)
        q = _pack_values(np.ascontiguousarray(v), m, fmt)
        return Packed(
            q, _interleave_rows(d, m), EMPTY_U16 if mm is None else _interleave_rows(mm, m), EMPTY_I8, EMPTY_I8
        )

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
        hbit = (hm[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        v = (low + 4 * hbit.reshape(m, nsb, 2, 4, 32)).astype(np.uint8).reshape(m, nsb * 16, 16)  # q + 4
    else:  # q2_K
        scb, qs = blk[..., 0:16], blk[..., 16:80].reshape(m, nsb, 2, 32)
        d, dmin = _f16_bits(blk[..., 80:82]), _f16_bits(blk[..., 82:84])
        sc, mn = scb & 15, scb >> 4
        v = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], 3).astype(np.uint8).reshape(m, nsb * 16, 16)
    q = _pack_values(np.ascontiguousarray(v), m, fmt)
    n_sub = k // fmt.sub
    neg_dmin = EMPTY_U16 if dmin is None else _interleave_rows(dmin ^ np.uint16(0x8000), m)  # -dmin, exact
    return Packed(
        q,
        _interleave_rows(d, m),
        neg_dmin,
        _interleave_rows(sc.reshape(m, n_sub).astype(np.int8), m),
        EMPTY_I8 if mn is None else _interleave_rows(mn.reshape(m, n_sub).astype(np.int8), m),
    )
