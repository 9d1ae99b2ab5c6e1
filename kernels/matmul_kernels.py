"""numba kernels behind kernels/matmul.py, on the row-interleaved layouts of kernels/repack.py.

Two kinds of kernel per layout (nib, i8, f32):

- ``gemv_*``: y = x @ W.T for a few tokens. One parallel launch; prange over groups of R = 32
  rows. The innermost loop runs over the 32 rows of a group, so it vectorizes into plain
  loads + int->float converts + FMAs with the activation broadcast, and the per-block scale
  is applied once per (block, row) — no horizontal sums anywhere. Scales come as f32 or as
  f16 bits (u16, widened by ``scale_f32``); numba compiles one specialization per dtype.
- ``decode_*``: dequantize the row groups [g0, g1) into a float panel ``f32 [k, cols]``
  (transposed, so the 32 rows of a group are contiguous). Used for prefill: a panel is
  decoded once per call and shared by all n tokens through one BLAS sgemm. Decoding is
  serial on purpose: OpenBLAS's threads and numba's OpenMP threads both spin-wait after
  their work, and alternating the two pools on 2 cores measured 2x slower than letting
  OpenBLAS alone run threaded (decode is ~10 % of the prefill time).
- the innermost loop always handles two values per row and step: with one (a tiny body)
  LLVM fully unrolls the 32 rows into scalar registers and gives up vectorizing (5x slower).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from llvmlite import ir
from numba.extending import intrinsic, overload

from kernels.repack import R

_U15 = np.uint8(15)
_U4 = np.uint8(4)


@intrinsic
def f16_bits_to_f32(typingctx, u):
    """An f16 bit pattern (any integer type, low 16 bits) -> float32, exactly (LLVM's fpext from
    half: one vcvtph2ps for 8 or 16 lanes with F16C). numba has no float16 type on the CPU."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 16:
            v = builder.trunc(v, ir.IntType(16)) if v.type.width > 16 else builder.zext(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(u), codegen


def scale_f32(v):
    """A block scale as float32: f32 as is, u16 as an f16 bit pattern (see the overload)."""
    raise NotImplementedError("only callable inside numba kernels")


@overload(scale_f32, inline="always")
def _scale_f32_impl(v):
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    if isinstance(v, types.Integer):
        return lambda v: f16_bits_to_f32(v)
    return None


@njit(parallel=True, fastmath=True, cache=True)
def gemv_nib(qs, d, mn, x, y):
    """qs u8 [G, nb, 16, R]; d, mn [G, nb, R] f32 or u16 (f16 bits); x f32 [n, k] -> y f32 [n, m]."""
    G, nb = qs.shape[0], qs.shape[1]
    n, m = y.shape
    for g in prange(G):
        acc = np.empty(R, np.float32)  # [R] row sums
        blk = np.empty(R, np.float32)  # [R] integer-valued block dot, before the scale
        for t in range(n):
            for r in range(R):
                acc[r] = 0.0
            for b in range(nb):
                x0 = b * 32
                xs = np.float32(0.0)
                for j in range(32):
                    xs += x[t, x0 + j]
                for r in range(R):
                    blk[r] = 0.0
                for j in range(16):
                    xl = x[t, x0 + j]
                    xh = x[t, x0 + 16 + j]
                    for r in range(R):
                        v = qs[g, b, j, r]
                        blk[r] += np.float32(np.uint8(v & _U15)) * xl + np.float32(np.uint8(v >> _U4)) * xh
                for r in range(R):
                    acc[r] += scale_f32(d[g, b, r]) * blk[r] + scale_f32(mn[g, b, r]) * xs
            r1 = min(R, m - g * R)
            for r in range(r1):
                y[t, g * R + r] = acc[r]


@njit(parallel=True, fastmath=True, cache=True)
def gemv_i8(q, d, mn, x, y):
    """q i8 [G, nb, B, R]; d [G, nb, R] f32 or u16 (f16 bits); mn like d, or an empty
    [0, 0, 0] array for the formats without an offset (no offset stream to read, no block
    sums of x); x f32 [n, k] -> y f32 [n, m]."""
    G, nb, B = q.shape[0], q.shape[1], q.shape[2]
    n, m = y.shape
    h = B // 2
    has_mn = mn.shape[0] > 0
    for g in prange(G):
        acc = np.empty(R, np.float32)
        blk = np.empty(R, np.float32)
        for t in range(n):
            for r in range(R):
                acc[r] = 0.0
            for b in range(nb):
                x0 = b * B
                for r in range(R):
                    blk[r] = 0.0
                # two values per step: with one, LLVM unrolls the 32 rows into scalars
                for j in range(h):
                    xa = x[t, x0 + j]
                    xb = x[t, x0 + h + j]
                    for r in range(R):
                        blk[r] += np.float32(q[g, b, j, r]) * xa + np.float32(q[g, b, h + j, r]) * xb
                if has_mn:
                    xs = np.float32(0.0)
                    for j in range(B):
                        xs += x[t, x0 + j]
                    for r in range(R):
                        acc[r] += scale_f32(d[g, b, r]) * blk[r] + scale_f32(mn[g, b, r]) * xs
                else:
                    for r in range(R):
                        acc[r] += scale_f32(d[g, b, r]) * blk[r]
            r1 = min(R, m - g * R)
            for r in range(r1):
                y[t, g * R + r] = acc[r]


@njit(parallel=True, fastmath=True, cache=True)
def gemv_f32(w, x, y):
    """w f32 [G, k, R], x f32 [n, k] -> y f32 [n, m]."""
    G, k = w.shape[0], w.shape[1]
    n, m = y.shape
    for g in prange(G):
        acc = np.empty(R, np.float32)
        for t in range(n):
            for r in range(R):
                acc[r] = 0.0
            for i in range(0, k - 1, 2):  # pairs, as in gemv_i8
                xa = x[t, i]
                xb = x[t, i + 1]
                for r in range(R):
                    acc[r] += w[g, i, r] * xa + w[g, i + 1, r] * xb
            if k % 2 == 1:
                xa = x[t, k - 1]
                for r in range(R):
                    acc[r] += w[g, k - 1, r] * xa
            r1 = min(R, m - g * R)
            for r in range(r1):
                y[t, g * R + r] = acc[r]


@njit(fastmath=True, cache=True)
def decode_nib(qs, d, mn, g0, out):
    """Row groups g0 .. g0 + out.shape[1] / R of the nib layout -> out f32 [k, cols]."""
    nb = qs.shape[1]
    ng = out.shape[1] // R
    for gg in range(ng):
        g = g0 + gg
        c0 = gg * R
        for b in range(nb):
            for j in range(16):
                for r in range(R):
                    v = qs[g, b, j, r]
                    out[b * 32 + j, c0 + r] = scale_f32(d[g, b, r]) * np.float32(np.uint8(v & _U15)) + scale_f32(mn[g, b, r])
                    out[b * 32 + 16 + j, c0 + r] = scale_f32(d[g, b, r]) * np.float32(np.uint8(v >> _U4)) + scale_f32(mn[g, b, r])


@njit(fastmath=True, cache=True)
def decode_i8(q, d, mn, g0, out):
    """Row groups of the i8 layout -> out f32 [k, cols]."""
    nb, B = q.shape[1], q.shape[2]
    ng = out.shape[1] // R
    has_mn = mn.shape[0] > 0
    for gg in range(ng):
        g = g0 + gg
        c0 = gg * R
        for b in range(nb):
            for j in range(B):
                if has_mn:
                    for r in range(R):
                        out[b * B + j, c0 + r] = scale_f32(d[g, b, r]) * np.float32(q[g, b, j, r]) + scale_f32(mn[g, b, r])
                else:
                    for r in range(R):
                        out[b * B + j, c0 + r] = scale_f32(d[g, b, r]) * np.float32(q[g, b, j, r])


@njit(fastmath=True, cache=True)
def decode_f32(w, g0, out):
    """Row groups of the f32 layout -> out f32 [k, cols]."""
    k = w.shape[1]
    ng = out.shape[1] // R
    for gg in range(ng):
        g = g0 + gg
        c0 = gg * R
        for i in range(k):
            for r in range(R):
                out[i, c0 + r] = w[g, i, r]
