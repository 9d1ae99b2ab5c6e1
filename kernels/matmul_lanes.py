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
(low nibbles) and 16 + 4s .. (high nibbles), 4 bytes a row, rows in order: the per-row integers
of lanes s and 4 + s. One 64-byte load of a step's 16 rows, its low nibbles dotted with x's 4
bytes of lane s broadcast (bcast_dot), gives lane s of all 16 rows in one vector, its high nibbles
lane 4 + s: so a lane of 16 rows is one float vector, the 8 lanes of the group's 32 rows are 16
vectors held in registers across the blocks, and hsum_float_8 is lane-wise adds of them, no
shuffles. The block scales d_w * d_x (and the summs) are computed once per token into a scratch
row (_run_items sizes qx for it).

The cost: per 4 values of a row a float conversion and an fma where the default order adds
integers (per 32-row block and token 16 integer dots + 16 conversions + 16 fmas against 16 + 2 +
2), so it is opt-in (KVCHAT_GGML_ORDER=1 or =q4_1, kernels/qlayout.py; docs/performance.md).

One token at a time, so a token's outputs are the same whatever else is in the batch (n = 1 or
512, any chunk or thread count): tests/test_matmul_int.py compares them with array_equal to a
numpy emulation of ggml's loop (tests/helpers/qref.py ggml_q4_1_q8_1).

``lanes_impl`` returns the njit-able body kernels/matmul_int._run_expanded runs for a format whose
QFormat.lanes is set (an overload's implementation, inlined there: no numba function of its own).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kvchat.kernels.qlayout import QFormat, R
from kvchat.kernels.simd import f32vec, vadd, vbcast, vfma, vload, vmul, vstore, vzero
from kvchat.kernels.simd_int import IsaType, _dot_codegen, _ptr, b64, bhi, blo, bload, bplane, i32x16

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_F32 = ir.FloatType()


def _lanes(n, idx):
    return ir.Constant(ir.VectorType(_I32, n), list(idx))


@intrinsic
def nib64_lo(typingctx, q, i):
    """Low nibbles of bytes i .. i+63 of q (16 rows x 4 packed bytes: values 4s .. 4s+3 of each)."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I8, 64)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vt), align=1)
        return builder.and_(v, ir.Constant(vt, [15] * 64))

    return b64(q, i), codegen


@intrinsic
def nib64_hi(typingctx, q, i):
    """High nibbles of bytes i .. i+63 of q (values 16 + 4s .. of each of 16 rows)."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I8, 64)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vt), align=1)
        return builder.lshr(v, ir.Constant(vt, [4] * 64))

    return b64(q, i), codegen


@intrinsic
def bcast_dot(typingctx, isa, w, x):
    """Per row of nib64_lo/_hi's 16: the integer dot of its 4 values with the 4 activation bytes
    of x (an i32 holding them), exact on every path."""
    if not (isinstance(isa, IsaType) and w == b64 and isinstance(x, types.Integer)):
        return None
    gen = _dot_codegen(isa.isa, False)

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(_I32, 16)
        x32 = context.cast(builder, args[2], sig.args[2], types.int32)
        xv = builder.insert_element(ir.Constant(vi, ir.Undefined), x32, ir.Constant(_I32, 0))
        xv = builder.shuffle_vector(xv, ir.Constant(vi, ir.Undefined), _lanes(16, [0] * 16))
        return gen(builder, ir.Constant(vi, None), args[1], builder.bitcast(xv, ir.VectorType(_I8, 64)))

    return i32x16(isa, w, x), codegen


_MAGIC = 0x4B400000  # the bits of 2^23 + 2^22: + an integer |i| < 2^22 in the low bits is that float + i


@intrinsic
def bcast_dot_f(typingctx, isa, w, x):
    """bcast_dot's 16 integers as float32, exactly: the dot accumulates onto the bits of
    2^23 + 2^22 (|dot| <= 4 * 15 * 128 < 2^22), so the lanes read as floats are 2^23 + 2^22 + dot,
    and one subtraction (exact) leaves float(dot): the conversion as an add on the integer
    unit's accumulator and a float subtract, instead of vcvtdq2ps (which shares a port with the dots)."""
    if not (isinstance(isa, IsaType) and w == b64 and isinstance(x, types.Integer)):
        return None
    gen = _dot_codegen(isa.isa, False)

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(_I32, 16)
        x32 = context.cast(builder, args[2], sig.args[2], types.int32)
        xv = builder.insert_element(ir.Constant(vi, ir.Undefined), x32, ir.Constant(_I32, 0))
        xv = builder.shuffle_vector(xv, ir.Constant(vi, ir.Undefined), _lanes(16, [0] * 16))
        r = gen(builder, ir.Constant(vi, [_MAGIC] * 16), args[1], builder.bitcast(xv, ir.VectorType(_I8, 64)))
        vf = ir.VectorType(_F32, 16)
        return builder.fsub(builder.bitcast(r, vf), ir.Constant(vf, [float(2**23 + 2**22)] * 16))

    return f32vec(isa, w, x), codegen


def _lane_dot_k(signed_w: bool):
    """bcast_dot_f with the float subtracted per call: kf = 2^23 + 2^22 + the lane's correction
    (_lane_k), for weights stored with an offset (q5_0's value + 16) or as signed bytes (q8_0,
    flipped to unsigned on VNNI: simd_int.s8_bias). The dot accumulates onto the bits of
    2^23 + 2^22, so the lanes read as floats are 2^23 + 2^22 + (unsigned dot) exactly, kf is an
    integer below 2^24 (exact), and one subtraction of two such floats leaves the exact
    float(signed dot)."""

    @intrinsic
    def dot(typingctx, isa, w, x, kf):
        if not (isinstance(isa, IsaType) and w == b64 and isinstance(x, types.Integer) and kf == types.float32):
            return None
        gen = _dot_codegen(isa.isa, signed_w)

        def codegen(context, builder, sig, args):
            vi = ir.VectorType(_I32, 16)
            vf = ir.VectorType(_F32, 16)
            x32 = context.cast(builder, args[2], sig.args[2], types.int32)
            xv = builder.insert_element(ir.Constant(vi, ir.Undefined), x32, ir.Constant(_I32, 0))
            xv = builder.shuffle_vector(xv, ir.Constant(vi, ir.Undefined), _lanes(16, [0] * 16))
            r = gen(builder, ir.Constant(vi, [_MAGIC] * 16), args[1], builder.bitcast(xv, ir.VectorType(_I8, 64)))
            k = builder.insert_element(ir.Constant(vf, ir.Undefined), args[3], ir.Constant(_I32, 0))
            k = builder.shuffle_vector(k, ir.Constant(vf, ir.Undefined), _lanes(16, [0] * 16))
            return builder.fsub(builder.bitcast(r, vf), k)

        return f32vec(isa, w, x, kf), codegen

    return dot


def _lane_k(off: int, signed_w: bool):
    """16 lanes' kf for _lane_dot_k from 16 activation words (two 32-blocks' 8 lanes each) of the
    int32 array a at flat index i: 2^23 + 2^22 + bias * (sum of the word's 4 signed bytes), bias =
    off, plus 128 where the path flips signed weights (VNNI). The byte sums by one integer dot
    with 1s, exact; the float steps exact (integers < 2^24)."""

    @intrinsic
    def kvec(typingctx, isa, a, i):
        if not (isinstance(isa, IsaType) and isinstance(a, types.Array) and a.dtype == types.int32):
            return None
        gen = _dot_codegen(isa.isa, False)
        bias = off + (128 if signed_w and isa.isa in ("vnni512", "vnni256") else 0)

        def codegen(context, builder, sig, args):
            vi = ir.VectorType(_I32, 16)
            vf = ir.VectorType(_F32, 16)
            xv = builder.load(_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2], vi), align=1)
            ones = ir.Constant(ir.VectorType(_I8, 64), [1] * 64)
            sums = gen(builder, ir.Constant(vi, None), ones, builder.bitcast(xv, ir.VectorType(_I8, 64)))
            f = builder.sitofp(builder.mul(sums, ir.Constant(vi, [bias] * 16)), vf)
            return builder.fadd(f, ir.Constant(vf, [float(2**23 + 2**22)] * 16))

        return f32vec(isa, a, i), codegen

    @intrinsic
    def kbias(typingctx, isa):
        if not isinstance(isa, IsaType):
            return None
        bias = off + (128 if signed_w and isa.isa in ("vnni512", "vnni256") else 0)

        def codegen(context, builder, sig, args):
            return ir.Constant(_I32, bias)

        return types.int32(isa), codegen

    return kvec, kbias


bcast_dot_q5_0 = _lane_dot_k(False)  # q5_0: values stored + 16 (nibble | bit-plane bit)
bcast_dot_q8_0 = _lane_dot_k(True)  # q8_0: signed bytes
kvec_q5_0, kbias_q5_0 = _lane_k(16, False)
kvec_q8_0, kbias_q8_0 = _lane_k(0, True)


@njit(cache=True, inline="always")
def _bcast_dot_q4_1(isa, w, x, kf):
    """bcast_dot_f with _lane_dot_k's signature (q4_1 needs no correction: kf unused)."""
    return bcast_dot_f(isa, w, x)


@njit(cache=True, inline="always")
def _k_last_block(bias, x32, tt, nb, sc_, ko):
    """The kf of the last block's 8 lanes one word at a time (an odd block count: no 16-word load
    past the row), the values kvec gives: 2^23 + 2^22 + bias * (sum of the word's 4 signed bytes)."""
    for j in range((nb - 1) * 8, nb * 8):
        v = np.int64(x32[tt, j])
        s4 = 0
        for i in range(4):
            s4 += (((v >> (8 * i)) & 0xFF) ^ 0x80) - 0x80
        sc_[ko + j] = np.float32(2**23 + 2**22 + bias * s4)


@njit(cache=True, inline="always")
def _k_q5_0(isa, x32, tt, nb, sc_, ko):
    """Token tt's kf of every lane of every block (nb * 8) into sc_[ko ..] (q5_0)."""
    n4 = x32.shape[1]
    for b in range(0, nb - 1, 2):
        vstore(sc_, ko + b * 8, kvec_q5_0(isa, x32, tt * n4 + b * 8))
    if nb % 2:
        _k_last_block(kbias_q5_0(isa), x32, tt, nb, sc_, ko)


@njit(cache=True, inline="always")
def _k_q8_0(isa, x32, tt, nb, sc_, ko):
    """_k_q5_0 for q8_0."""
    n4 = x32.shape[1]
    for b in range(0, nb - 1, 2):
        vstore(sc_, ko + b * 8, kvec_q8_0(isa, x32, tt * n4 + b * 8))
    if nb % 2:
        _k_last_block(kbias_q8_0(isa), x32, tt, nb, sc_, ko)


@njit(cache=True, inline="always")
def _k_none(isa, x32, tt, nb, sc_, ko):
    """q4_1: no corrections."""
    return


@njit(cache=True, inline="always")
def _pair_q4_1(q, base, s, hh):
    """Lanes s and 4 + s of rows 16 hh .. 16 hh + 15 of the nibble sub-block at byte base."""
    o = base + s * 128 + 64 * hh
    return nib64_lo(q, o), nib64_hi(q, o)


@njit(cache=True, inline="always")
def _pair_q5_0(q, base, s, hh):
    """_pair_q4_1 for a 5-bit sub-block: the nibbles with the bit plane's fifth bits ORed in
    (words low 0-15, low 16-31, high 0-15, high 16-31 of step s after the 512 nibble bytes)."""
    v = bload(q, base + s * 128 + 64 * hh)
    pb = base + 16 * R + s * 32 + 8 * hh
    return bplane(blo(v), q, pb, 16), bplane(bhi(v), q, pb + 16, 16)


@njit(cache=True, inline="always")
def _pair_q8_0(q, base, s, hh):
    """Lanes s and 4 + s of rows 16 hh .. of a byte sub-block ([8 steps, 32 rows, 4 bytes])."""
    return bload(q, base + s * 128 + 64 * hh), bload(q, base + (4 + s) * 128 + 64 * hh)


@njit(cache=True, inline="always")
def _lane_scales(d, m, xd, xm, tt, g, nb, lmin, sc_, o):
    """Token tt's block scales d_w * d_x of the group's 32 rows into sc_[o + 32 b ..], then the
    32 summs (the in-order sum over the blocks of m_w * s_x) at sc_[o + 32 nb ..]."""
    s0, s1 = vzero(), vzero()
    for b in range(nb):
        so = (g * nb + b) * R
        dx = vbcast(xd[tt, b])
        vstore(sc_, o + b * R, vmul(vload(d, so), dx))
        vstore(sc_, o + b * R + 16, vmul(vload(d, so + 16), dx))
        if lmin:
            sx = vbcast(xm[tt, b])
            s0 = vfma(vload(m, so), sx, s0)
            s1 = vfma(vload(m, so + 16), sx, s1)
    vstore(sc_, o + nb * R, s0)
    vstore(sc_, o + nb * R + 16, s1)


@njit(cache=True, inline="always")
def _hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    """hsum_float_8 lane-wise: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    return vadd(vadd(vadd(a0, a4), vadd(a2, a6)), vadd(vadd(a1, a5), vadd(a3, a7)))


@njit(cache=True, inline="always")
def _lane_store(y, src, o, tt, g):
    """Token tt's 32 outputs of row group g from src[o .. o + 32] (rows past y's end dropped)."""
    n_rows = y.shape[1]
    if g * R + R <= n_rows:
        vstore(y, tt * n_rows + g * R, vload(src, o))
        vstore(y, tt * n_rows + g * R + 16, vload(src, o + 16))
    else:
        for r in range(n_rows - g * R):
            y[tt, g * R + r] = src[o + r]


def lanes_impl(fmt: QFormat):
    """The implementation of _run_expanded (kernels/matmul_int.py) for a lane-order format: runs
    tokens t .. t1 - 1 of row group g and returns True."""
    assert fmt.lanes and fmt.sub == 32 and fmt.n_sub == 1 and fmt.name in ("q4_1", "q5_0", "q8_0")
    lmin = fmt.lmin
    # one 32-row block: 4 steps x 32 rows x 4 nibble bytes (+ q5_0's 4 plane words a step), or
    # q8_0's 8 steps x 32 rows x 4 bytes
    sub_bytes = fmt.sub_bytes
    if fmt.name == "q4_1":
        pair, dotf, kfill = _pair_q4_1, _bcast_dot_q4_1, _k_none
    elif fmt.name == "q5_0":
        pair, dotf, kfill = _pair_q5_0, bcast_dot_q5_0, _k_q5_0
    else:
        pair, dotf, kfill = _pair_q8_0, bcast_dot_q8_0, _k_q8_0

    def impl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):  # runs whatever expand says
        nb = xd.shape[1]
        n_rows = y.shape[1]
        sc_ = qx.view(np.float32)  # per block the 32 rows' d_w * d_x, then the 32 summs (_run_items sizes it)
        o2 = (nb + 1) * R  # the second token's scales; its outputs after them
        ko = 2 * o2 + 2 * R  # the two tokens' lane corrections kf (q5_0, q8_0: nb * 8 each)
        kb = ko + nb * 8
        tt = t
        while tt + 2 <= t1:  # two tokens share each 16 rows' nibble loads, 16 rows at a time
            _lane_scales(d, m, xd, xm, tt, g, nb, lmin, sc_, 0)
            _lane_scales(d, m, xd, xm, tt + 1, g, nb, lmin, sc_, o2)
            kfill(isa, x32, tt, nb, sc_, ko)
            kfill(isa, x32, tt + 1, nb, sc_, kb)
            for hh in range(2):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()  # token tt, lane l of rows 16hh ..
                b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vzero()  # token tt + 1
                for b in range(nb):
                    ea = vload(sc_, b * R + 16 * hh)
                    eb = vload(sc_, o2 + b * R + 16 * hh)
                    base = (g * nb + b) * sub_bytes
                    xo = b * 8
                    lo, hi = pair(q, base, 0, hh)
                    a0 = vfma(ea, dotf(isa, lo, x32[tt, xo], sc_[ko + xo]), a0)
                    a4 = vfma(ea, dotf(isa, hi, x32[tt, xo + 4], sc_[ko + xo + 4]), a4)
                    b0 = vfma(eb, dotf(isa, lo, x32[tt + 1, xo], sc_[kb + xo]), b0)
                    b4 = vfma(eb, dotf(isa, hi, x32[tt + 1, xo + 4], sc_[kb + xo + 4]), b4)
                    lo, hi = pair(q, base, 1, hh)
                    a1 = vfma(ea, dotf(isa, lo, x32[tt, xo + 1], sc_[ko + xo + 1]), a1)
                    a5 = vfma(ea, dotf(isa, hi, x32[tt, xo + 5], sc_[ko + xo + 5]), a5)
                    b1 = vfma(eb, dotf(isa, lo, x32[tt + 1, xo + 1], sc_[kb + xo + 1]), b1)
                    b5 = vfma(eb, dotf(isa, hi, x32[tt + 1, xo + 5], sc_[kb + xo + 5]), b5)
                    lo, hi = pair(q, base, 2, hh)
                    a2 = vfma(ea, dotf(isa, lo, x32[tt, xo + 2], sc_[ko + xo + 2]), a2)
                    a6 = vfma(ea, dotf(isa, hi, x32[tt, xo + 6], sc_[ko + xo + 6]), a6)
                    b2 = vfma(eb, dotf(isa, lo, x32[tt + 1, xo + 2], sc_[kb + xo + 2]), b2)
                    b6 = vfma(eb, dotf(isa, hi, x32[tt + 1, xo + 6], sc_[kb + xo + 6]), b6)
                    lo, hi = pair(q, base, 3, hh)
                    a3 = vfma(ea, dotf(isa, lo, x32[tt, xo + 3], sc_[ko + xo + 3]), a3)
                    a7 = vfma(ea, dotf(isa, hi, x32[tt, xo + 7], sc_[ko + xo + 7]), a7)
                    b3 = vfma(eb, dotf(isa, lo, x32[tt + 1, xo + 3], sc_[kb + xo + 3]), b3)
                    b7 = vfma(eb, dotf(isa, hi, x32[tt + 1, xo + 7], sc_[kb + xo + 7]), b7)
                ra = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7)
                rb = _hsum8(b0, b1, b2, b3, b4, b5, b6, b7)
                if lmin:  # + summs (q4_1); ggml's q8_0-type dots end at the tree
                    ra = vadd(ra, vload(sc_, nb * R + 16 * hh))
                    rb = vadd(rb, vload(sc_, o2 + nb * R + 16 * hh))
                vstore(sc_, 2 * o2 + 16 * hh, ra)
                vstore(sc_, 2 * o2 + R + 16 * hh, rb)
            _lane_store(y, sc_, 2 * o2, tt, g)
            _lane_store(y, sc_, 2 * o2 + R, tt + 1, g)
            tt += 2
        for tt in range(tt, t1):
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
            kfill(isa, x32, tt, nb, sc_, ko)
            # lane l of rows 0-15 in a0l, of rows 16-31 in a1l: per step s one 64-byte load of 16
            # rows' packed bytes gives lanes s (low nibbles) and 4 + s (high) of all 16
            a00 = a01 = a02 = a03 = a04 = a05 = a06 = a07 = vzero()
            a10 = a11 = a12 = a13 = a14 = a15 = a16 = a17 = vzero()
            for b in range(nb):
                e0 = vload(sc_, b * R)
                e1 = vload(sc_, b * R + 16)
                base = (g * nb + b) * sub_bytes
                xo = b * 8
                x0, x1, x2, x3 = x32[tt, xo], x32[tt, xo + 1], x32[tt, xo + 2], x32[tt, xo + 3]
                x4, x5, x6, x7 = x32[tt, xo + 4], x32[tt, xo + 5], x32[tt, xo + 6], x32[tt, xo + 7]
                lo, hi = pair(q, base, 0, 0)
                a00 = vfma(e0, dotf(isa, lo, x0, sc_[ko + xo + 0]), a00)
                a04 = vfma(e0, dotf(isa, hi, x4, sc_[ko + xo + 4]), a04)
                lo, hi = pair(q, base, 0, 1)
                a10 = vfma(e1, dotf(isa, lo, x0, sc_[ko + xo + 0]), a10)
                a14 = vfma(e1, dotf(isa, hi, x4, sc_[ko + xo + 4]), a14)
                lo, hi = pair(q, base, 1, 0)
                a01 = vfma(e0, dotf(isa, lo, x1, sc_[ko + xo + 1]), a01)
                a05 = vfma(e0, dotf(isa, hi, x5, sc_[ko + xo + 5]), a05)
                lo, hi = pair(q, base, 1, 1)
                a11 = vfma(e1, dotf(isa, lo, x1, sc_[ko + xo + 1]), a11)
                a15 = vfma(e1, dotf(isa, hi, x5, sc_[ko + xo + 5]), a15)
                lo, hi = pair(q, base, 2, 0)
                a02 = vfma(e0, dotf(isa, lo, x2, sc_[ko + xo + 2]), a02)
                a06 = vfma(e0, dotf(isa, hi, x6, sc_[ko + xo + 6]), a06)
                lo, hi = pair(q, base, 2, 1)
                a12 = vfma(e1, dotf(isa, lo, x2, sc_[ko + xo + 2]), a12)
                a16 = vfma(e1, dotf(isa, hi, x6, sc_[ko + xo + 6]), a16)
                lo, hi = pair(q, base, 3, 0)
                a03 = vfma(e0, dotf(isa, lo, x3, sc_[ko + xo + 3]), a03)
                a07 = vfma(e0, dotf(isa, hi, x7, sc_[ko + xo + 7]), a07)
                lo, hi = pair(q, base, 3, 1)
                a13 = vfma(e1, dotf(isa, lo, x3, sc_[ko + xo + 3]), a13)
                a17 = vfma(e1, dotf(isa, hi, x7, sc_[ko + xo + 7]), a17)
            # hsum_float_8: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then + summs (q4_1)
            r0 = vadd(vadd(a00, a04), vadd(a02, a06))
            r0 = vadd(r0, vadd(vadd(a01, a05), vadd(a03, a07)))
            r1 = vadd(vadd(a10, a14), vadd(a12, a16))
            r1 = vadd(r1, vadd(vadd(a11, a15), vadd(a13, a17)))
            if lmin:
                r0 = vadd(r0, vload(sc_, nb * R))
                r1 = vadd(r1, vload(sc_, nb * R + 16))
            vstore(ym, 0, r0)
            vstore(ym, 16, r1)
            if g * R + R <= n_rows:
                vstore(y, tt * n_rows + g * R, vload(ym, 0))
                vstore(y, tt * n_rows + g * R + 16, vload(ym, 16))
            else:
                for r in range(n_rows - g * R):
                    y[tt, g * R + r] = ym[r]
        return True

    return impl
