"""ggml's AVX2 float order for the legacy nibble formats with an offset term (q4_1), in the integer kernel.

ggml_vec_dot_q4_1_q8_1 (ggml-cpu/arch/x86/quants.c, the path every x86 build with AVX2 runs)
keeps, per output, 8 float lanes across the row's 32-blocks: lane l holds the integer dot of the
block's values 4l .. 4l+3 (values 0-15 are the low nibbles, 16-31 the high ones), scaled as
acc_l = fma(d_w * d_x, float(i_l), acc_l), blocks in order from +0; then hsum_float_8 adds the
lanes as ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), and the result + summs, the in-order
f32 sum over the blocks of m_w * s_x (exact products). Any other order differs in the last bits
of some outputs, and through the next activation's 8-bit roundings the whole forward drifts from
llama.cpp's as far as a second independent rounding would (docs/performance.md, "Accuracy").

In kernels/qlayout.py's layout, step s of a 32-row sub-block holds each row's values 4s .. 4s+3
(low nibbles) and 16 + 4s .. (high nibbles): the per-row integers of lanes s and 4 + s. The
kernel walks a row group 8 rows at a time (rows keep to SIMD lanes, as in the rest of
kernels/matmul_int.py): the 32 bytes of 8 rows of a step, split into their low and high nibbles,
make one 64-byte vector whose dot with (x of lane s | x of lane 4 + s) gives both lanes' integers
for the 8 rows (pair_dot), so all 8 lanes of 8 rows are 4 float vectors (8 ymm on AVX2) held in
registers across the blocks; the block scales d_w * d_x (and the summs) are computed once per
token into a scratch row (_run_items sizes qx for it).

The cost: per 4 values of a row, a float conversion and an fma where the default order has an
integer add (32 + 32 vector ops per 32-row block against 4 + 4): one token ~1.45x the default
kernel's time on this AVX2 EPYC, so it is opt-in (KVCHAT_GGML_ORDER=1, kernels/qlayout.py).

One token at a time, so a token's outputs are the same whatever else is in the batch (n = 1 or
512, any chunk or thread count): tests/test_matmul_int.py compares them with array_equal to a
numpy emulation of ggml's loop (tests/helpers/qref.py ggml_q4_1_q8_1).

``lanes_impl`` returns the njit-able body kernels/matmul_int._run_expanded runs for a format whose
QFormat.lanes is set (an overload's implementation, inlined there: no numba function of its own).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvchat.kernels.qlayout import QFormat, R
from kvchat.kernels.simd import f32vec, vadd, vbcast, vfma, vload, vmul, vstore, vzero
from kvchat.kernels.simd_int import IsaType, _dot_codegen, _ptr, b64, i32x16, itof

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_F32 = ir.FloatType()


def _lanes(n, idx):
    return ir.Constant(ir.VectorType(_I32, n), list(idx))


@intrinsic
def nib_pair(typingctx, q, i):
    """Bytes i .. i+31 of q (8 rows x 4 packed bytes) as 64 values: their low nibbles (values 4s ..
    4s+3 of each row), then their high nibbles (16 + 4s ..)."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I8, 32)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vt), align=1)
        lo = builder.and_(v, ir.Constant(vt, [15] * 32))
        hi = builder.lshr(v, ir.Constant(vt, [4] * 32))
        return builder.shuffle_vector(lo, hi, _lanes(64, range(64)))

    return b64(q, i), codegen


@intrinsic
def pair_dot(typingctx, isa, w, xl, xh):
    """Per row of nib_pair's 8: lanes 0-7 the integer dot of its 4 low-nibble values with the 4
    activation bytes in xl, lanes 8-15 of its high-nibble values with xh (exact on every path)."""
    if not (isinstance(isa, IsaType) and w == b64 and isinstance(xl, types.Integer) and isinstance(xh, types.Integer)):
        return None
    gen = _dot_codegen(isa.isa, False)

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(_I32, 16)
        x = ir.Constant(vi, ir.Undefined)
        x = builder.insert_element(x, context.cast(builder, args[2], sig.args[2], types.int32), ir.Constant(_I32, 0))
        x = builder.insert_element(x, context.cast(builder, args[3], sig.args[3], types.int32), ir.Constant(_I32, 1))
        x = builder.shuffle_vector(x, ir.Constant(vi, ir.Undefined), _lanes(16, [0] * 8 + [1] * 8))
        return gen(builder, ir.Constant(vi, None), args[1], builder.bitcast(x, ir.VectorType(_I8, 64)))

    return i32x16(isa, w, xl, xh), codegen


@intrinsic
def vload_dup8(typingctx, a, i):
    """Elements i .. i+7 of a float32 array, twice (lanes 0-7 and 8-15)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_F32, 8)
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        v = builder.load(builder.bitcast(builder.gep(ary.data, [idx]), vt.as_pointer()), align=4)
        return builder.shuffle_vector(v, v, _lanes(16, list(range(8)) * 2))

    return f32vec(a, i), codegen


@intrinsic
def vfold8(typingctx, v):
    """Lanes 0-7 + lanes 8-15 (one rounding each), in lanes 0-7 and again in 8-15."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        lo = builder.shuffle_vector(args[0], args[0], _lanes(8, range(8)))
        hi = builder.shuffle_vector(args[0], args[0], _lanes(8, range(8, 16)))
        s = builder.fadd(lo, hi)
        return builder.shuffle_vector(s, s, _lanes(16, list(range(8)) * 2))

    return f32vec(v), codegen


@intrinsic
def vstore8(typingctx, a, i, v):
    """a[i .. i+7] = lanes 0-7 of v (a float32 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(i, types.Integer) and v == f32vec):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_F32, 8)
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        lo = builder.shuffle_vector(args[2], args[2], _lanes(8, range(8)))
        builder.store(lo, builder.bitcast(builder.gep(ary.data, [idx]), vt.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(a, i, v), codegen


def lanes_impl(fmt: QFormat):
    """The implementation of _run_expanded (kernels/matmul_int.py) for a lane-order format: runs
    tokens t .. t1 - 1 of row group g and returns True."""
    assert fmt.lanes and fmt.nib and fmt.sub == 32 and fmt.n_sub == 1 and fmt.planes == 0 and fmt.offset == 0
    lmin = fmt.lmin
    sub_bytes = 32 * R // 2  # one 32-row block of nibbles: 4 steps x 32 rows x 4 bytes

    def impl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):  # runs whatever expand says
        nb = xd.shape[1]
        n_rows = y.shape[1]
        sc_ = qx.view(np.float32)  # per block the 32 rows' d_w * d_x, then the 32 summs (_run_items sizes it)
        for tt in range(t, t1):
            s0, s1 = vzero(), vzero()
            for b in range(nb):
                so = (g * nb + b) * R
                dx = vbcast(xd[tt, b])
                vstore(sc_, b * R, vmul(vload(d, so), dx))
                vstore(sc_, b * R + 16, vmul(vload(d, so + 16), dx))
                if lmin:
                    sx = vbcast(xm[tt, b])
                    s0 = vfma(vload(m, so), sx, s0)
                    s1 = vfma(vload(m, so + 16), sx, s1)
            vstore(sc_, nb * R, s0)
            vstore(sc_, nb * R + 16, s1)
            for c in range(4):  # rows 8c .. 8c+7: their 8 lanes in 4 vectors (lanes s | 4 + s)
                a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
                for b in range(nb):
                    e = vload_dup8(sc_, b * R + 8 * c)
                    base = (g * nb + b) * sub_bytes + 32 * c
                    xo = b * 8
                    a0 = vfma(e, itof(pair_dot(isa, nib_pair(q, base), x32[tt, xo], x32[tt, xo + 4])), a0)
                    a1 = vfma(e, itof(pair_dot(isa, nib_pair(q, base + 128), x32[tt, xo + 1], x32[tt, xo + 5])), a1)
                    a2 = vfma(e, itof(pair_dot(isa, nib_pair(q, base + 256), x32[tt, xo + 2], x32[tt, xo + 6])), a2)
                    a3 = vfma(e, itof(pair_dot(isa, nib_pair(q, base + 384), x32[tt, xo + 3], x32[tt, xo + 7])), a3)
                u = vadd(vfold8(a0), vfold8(a2))
                v = vadd(vfold8(a1), vfold8(a3))
                vstore8(ym, 8 * c, vadd(vadd(u, v), vload_dup8(sc_, nb * R + 8 * c)))
            if g * R + R <= n_rows:
                vstore(y, tt * n_rows + g * R, vload(ym, 0))
                vstore(y, tt * n_rows + g * R + 16, vload(ym, 16))
            else:
                for r in range(n_rows - g * R):
                    y[tt, g * R + r] = ym[r]
        return True

    return impl
