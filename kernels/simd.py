"""Explicit 16-lane float32 vectors for numba kernels: one LLVM instruction per call, in the order written.

Why: numba leaves vectorization to LLVM's loop vectorizer, which (a) only vectorizes innermost
loops, so a register-blocked matmul (several tokens' accumulators held in registers over a
loop) cannot be expressed, and (b) with ``fastmath`` may reassociate sums differently in
different loop nests, so the same dot product can round differently depending on which loop
computed it. These intrinsics make both explicit: a ``F32Vec`` value is an LLVM
``<16 x float>`` (one zmm register with AVX-512, two ymm otherwise), ``vfma`` is ``llvm.fma``
(one rounding, always fused), ``vadd`` a plain ``fadd`` without fast-math flags. LLVM may
schedule and allocate registers freely but cannot change any result, so a kernel built from
them computes every output element with the operation sequence its source spells out.

All loads/stores take an array and a flat element index (the array must be C-contiguous; no
bounds check: the caller keeps ``i + 16 <= a.size``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)


class F32Vec(types.Type):
    """numba type of a <16 x float> register value."""

    def __init__(self):
        super().__init__(name=f"f32x{LANES}")


f32vec = F32Vec()


@register_model(F32Vec)
class _F32VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


def _vec_ptr(context, builder, aryty, ary, idxty, idx):
    """Pointer to elements idx .. idx + 15 of a contiguous array, typed as a vector pointer."""
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, idx, idxty, types.intp)
    elt = context.get_data_type(aryty.dtype)
    return builder.bitcast(builder.gep(a.data, [i]), ir.VectorType(elt, LANES).as_pointer())


@intrinsic
def vzero(typingctx):
    """All lanes +0.0."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, None)

    return f32vec(), codegen


@intrinsic
def vbcast(typingctx, x):
    """A scalar (converted to float32) in all lanes."""
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        vec = builder.insert_element(ir.Constant(_VF, ir.Undefined), v, ir.Constant(_I32, 0))
        return builder.shuffle_vector(
            vec, ir.Constant(_VF, ir.Undefined), ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
        )

    return f32vec(x), codegen


@intrinsic
def vload(typingctx, a, i):
    """Elements i .. i+15 of a as float32, exactly: f32 as is, u16 as f16 bit patterns (one
    vcvtph2ps), i16 as bf16 bit patterns (the upper half of an f32), i8 / u8 converted from the
    integer."""
    if not (isinstance(a, types.Array) and isinstance(i, types.Integer)):
        return None
    dt = a.dtype
    if dt not in (types.float32, types.uint16, types.int16, types.int8, types.uint8):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=1)
        if dt in (types.float32, types.uint16):
            return _float_lanes(builder, v, dt)
        if dt == types.int16:
            vi = ir.VectorType(_I32, LANES)
            return builder.bitcast(builder.shl(builder.zext(v, vi), ir.Constant(vi, [16] * LANES)), _VF)
        if dt == types.int8:
            return builder.sitofp(v, _VF)
        return builder.uitofp(v, _VF)

    return f32vec(a, i), codegen


def _float_lanes(builder, v, dt):
    """LANES loaded f32 values as they are, or f16 bit patterns (u16) widened (one vcvtph2ps):
    what vload and vscale share."""
    if dt == types.float32:
        return v
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), LANES)), _VF)


@intrinsic
def vscale(typingctx, a, i):
    """Elements i .. i+15 of a block-scale array as float32, exactly: f32 as is, u16 as f16 bit
    patterns, u8 as e8m0 exponent bytes halved, 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF:
    mxfp4's scale, its table values being doubled; e < 2 gives the subnormals 2^-128, 2^-127)."""
    if not (isinstance(a, types.Array) and isinstance(i, types.Integer)):
        return None
    if a.dtype not in (types.float32, types.uint16, types.uint8):
        return None
    dt = a.dtype

    def codegen(context, builder, sig, args):
        v = builder.load(_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=1)
        if dt in (types.float32, types.uint16):
            return _float_lanes(builder, v, dt)
        vi = ir.VectorType(_I32, LANES)
        e = builder.zext(v, vi)
        normal = builder.shl(builder.sub(e, ir.Constant(vi, [1] * LANES)), ir.Constant(vi, [23] * LANES))
        tiny = builder.shl(ir.Constant(vi, [0x00200000] * LANES), e)  # e = 0, 1: 2^-128, 2^-127
        small = builder.icmp_unsigned("<", e, ir.Constant(vi, [2] * LANES))
        return builder.bitcast(builder.select(small, tiny, normal), _VF)

    return f32vec(a, i), codegen


def _nibble_loader(high: bool):
    @intrinsic
    def load(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.uint8 and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v = builder.load(_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=1)
            vt = ir.VectorType(ir.IntType(8), LANES)
            if high:
                v = builder.lshr(v, ir.Constant(vt, [4] * LANES))
            else:
                v = builder.and_(v, ir.Constant(vt, [15] * LANES))
            return builder.uitofp(v, _VF)

        return f32vec(a, i), codegen

    return load


vload_lo = _nibble_loader(False)
vload_lo.__doc__ = "Low nibbles of bytes i .. i+15 of a u8 array, as float32 0..15."
vload_hi = _nibble_loader(True)
vload_hi.__doc__ = "High nibbles of bytes i .. i+15 of a u8 array, as float32 0..15."


@intrinsic
def vstore(typingctx, a, i, v):
    """a[i .. i+15] = v (a float32 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(i, types.Integer) and v == f32vec):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=4)
        return context.get_dummy_value()

    return types.none(a, i, v), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma: always fused, never split or reordered)."""
    if not (a == b == c == f32vec):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), f"llvm.fma.v{LANES}f32")
        return builder.call(fn, args)

    return f32vec(a, b, c), codegen


def _lanewise(name: str, doc: str, emit):
    """An intrinsic f32vec(a, b) computing emit(builder, a, b) lane by lane (vadd, vmul, ...)."""

    def typer(typingctx, a, b):
        if not (a == b == f32vec):
            return None

        def codegen(context, builder, sig, args):
            return emit(builder, args[0], args[1])

        return f32vec(a, b), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _select_max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


vadd = _lanewise("vadd", "a + b lane by lane.", lambda b, x, y: b.fadd(x, y))
vsub = _lanewise("vsub", "a - b lane by lane.", lambda b, x, y: b.fsub(x, y))
vmul = _lanewise("vmul", "a * b lane by lane (one rounding).", lambda b, x, y: b.fmul(x, y))
vmax = _lanewise("vmax", "Lane by lane a if a > b else b (the scalar max of two non-NaN floats).", _select_max)


def _halving_tree(builder, x, combine):
    """Reduce the 16 lanes of x to lane 0 in one fixed tree: combine(lanes i, lanes i + n/2) for
    n = 16, 8, 4, 2 (vhsum's sum, vhmax's max)."""
    n = LANES
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        x, n = combine(lo, hi), h
    return builder.extract_element(x, ir.Constant(_I32, 0))


@intrinsic
def vhsum(typingctx, v):
    """The sum of the 16 lanes, always in the same tree: lanes i + (i + 8), then i + (i + 4), ..."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return _halving_tree(builder, args[0], builder.fadd)

    return types.float32(v), codegen


def _pair_halves(builder, a, b, h):
    """One level of a 16-row transpose-reduce: a and b each hold 16 / (2h) rows of 2h lanes;
    the result holds each row's h sums lane i + lane (i + h), rows of a then rows of b, in order."""
    blocks = 2 * LANES // (2 * h)
    lo = [2 * h * blk + i for blk in range(blocks) for i in range(h)]
    hi = [2 * h * blk + h + i for blk in range(blocks) for i in range(h)]
    mk = lambda idx: ir.Constant(ir.VectorType(_I32, LANES), idx)  # noqa: E731
    return builder.fadd(builder.shuffle_vector(a, b, mk(lo)), builder.shuffle_vector(a, b, mk(hi)))


@intrinsic
def vhsum16(typingctx, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Lane i of the result = vhsum(x_i), bit for bit: the 16 trees are run side by side (a
    transpose-reduce), each add the very lane pair vhsum adds, lo + hi. 15 shuffle pairs and
    15 adds for 16 sums instead of 4 each: K·q of 16 cells in one vector."""
    args = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    if any(a != f32vec for a in args):
        return None

    def codegen(context, builder, sig, args):
        vecs, h = list(args), LANES // 2
        while len(vecs) > 1:
            vecs = [_pair_halves(builder, vecs[i], vecs[i + 1], h) for i in range(0, len(vecs), 2)]
            h //= 2
        return vecs[0]

    return f32vec(*args), codegen


@intrinsic
def vhmax(typingctx, v):
    """The largest of the 16 lanes (a max is exact, so the tree's order cannot change it)."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return _halving_tree(builder, args[0], lambda lo, hi: _select_max(builder, lo, hi))

    return types.float32(v), codegen


@intrinsic
def prefetch(typingctx, a, i):
    """Hint the cache line of flat element i of a (any contiguous array) into all cache levels
    (llvm.prefetch, read): no effect on any value, only on when memory is read."""
    if not (isinstance(a, types.Array) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(ary.data, [idx]), ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0i8",
        )
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(a, i), codegen


_EXP_C = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@intrinsic
def vexp_le0(typingctx, v):
    """kernels/attention_tiles.exp_le0 on 16 lanes, operation for operation (the same plain
    IEEE multiplies and adds, no fusing), so every lane is the scalar function's bits."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        def c(x):
            return ir.Constant(_VF, [float(__import__("numpy").float32(x))] * LANES)

        x = args[0]
        lo = c(-87.0)
        xc = builder.select(builder.fcmp_ordered(">", x, lo), x, lo)  # max(x, -87)
        rnd = c(12582912.0)
        n = builder.fsub(builder.fadd(builder.fmul(xc, c(1.4426950408889634)), rnd), rnd)
        r = builder.fsub(xc, builder.fmul(n, c(0.693359375)))
        r = builder.fadd(r, builder.fmul(n, c(2.12194440e-4)))
        p = c(_EXP_C[0])
        for k in _EXP_C[1:]:
            p = builder.fadd(builder.fmul(p, r), c(k))
        y = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
        vi = ir.VectorType(_I32, LANES)
        e = builder.shl(
            builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * LANES)), ir.Constant(vi, [23] * LANES)
        )
        y = builder.fmul(y, builder.bitcast(e, _VF))
        return builder.select(builder.fcmp_ordered(">", x, lo), y, ir.Constant(_VF, None))

    return f32vec(v), codegen


@intrinsic
def vany_eq0(typingctx, a, b):
    """True if some lane of a or of b is +-0.0."""
    if not (a == b == f32vec):
        return None

    def codegen(context, builder, sig, args):
        z = ir.Constant(_VF, None)
        m = builder.or_(builder.fcmp_ordered("==", args[0], z), builder.fcmp_ordered("==", args[1], z))
        bits = builder.bitcast(m, ir.IntType(LANES))
        return builder.icmp_unsigned("!=", bits, ir.Constant(ir.IntType(LANES), 0))

    return types.boolean(a, b), codegen


@intrinsic
def vround_f16(typingctx, v):
    """Each lane rounded to the nearest IEEE half (ties to even; subnormal halves, overflow to
    inf), back as f32: ggml's f32 -> f16 conversion (vcvtps2ph with round-to-nearest on x86),
    which its matmuls apply to an f32 operand before an f16 dot."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.VectorType(ir.HalfType(), LANES)), _VF)

    return f32vec(v), codegen


@intrinsic
def vround_bf16(typingctx, v):
    """Each lane rounded to the nearest bfloat16 (ties to even, in the float's bits), back as f32:
    ggml's f32 -> bf16 conversion for finite values (NaN keeps no particular payload here)."""
    if v != f32vec:
        return None

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(_I32, LANES)

        def k(x):
            return ir.Constant(vi, [x] * LANES)

        u = builder.bitcast(args[0], vi)
        odd = builder.and_(builder.lshr(u, k(16)), k(1))
        r = builder.add(builder.add(u, k(0x7FFF)), odd)
        return builder.bitcast(builder.and_(r, k(-65536)), _VF)

    return f32vec(v), codegen


def _transpose_lanes(builder, rows):
    """The 16 x 16 transpose of 16 row vectors: 4 stages, stage b swapping bit b of the row and the
    column index (the off-diagonal b-blocks of every 2b-block), 2 shuffles a row pair a stage."""
    rows = list(rows)
    b = LANES // 2
    while b >= 1:
        lo = [c if not c & b else LANES + c - b for c in range(LANES)]  # row r: (r, c) or (r + b, c - b)
        hi = [c + b if not c & b else LANES + c for c in range(LANES)]  # row r + b: (r, c + b) or (r + b, c)
        mk = lambda idx: ir.Constant(ir.VectorType(_I32, LANES), idx)  # noqa: E731
        new = list(rows)
        for r in range(LANES):
            if not r & b:
                new[r] = builder.shuffle_vector(rows[r], rows[r + b], mk(lo))
                new[r + b] = builder.shuffle_vector(rows[r], rows[r + b], mk(hi))
        rows, b = new, b // 2
    return rows


def _strided(context, builder, base, bt, stride, st, k: int):
    """base + stride * k as an intp (base of numba type bt, stride of st; k a constant)."""
    b = context.cast(builder, base, bt, types.intp)
    return builder.add(b, builder.mul(context.cast(builder, stride, st, types.intp), ir.Constant(ir.IntType(64), k)))


@intrinsic
def vtranspose16(typingctx, src, i, si, dst, j, dj):
    """dst[j + c * dj + r] = src[i + r * si + c] for r, c < 16 (float32 arrays, flat indices):
    a 16 x 16 block copied transposed, by shuffles (values unchanged)."""
    if not (
        isinstance(src, types.Array)
        and isinstance(dst, types.Array)
        and src.dtype == dst.dtype == types.float32
        and all(isinstance(x, types.Integer) for x in (i, si, j, dj))
    ):
        return None

    def codegen(context, builder, sig, args):
        s, i_, si_, d, j_, dj_ = args
        ts = sig.args
        rows = [
            builder.load(
                _vec_ptr(context, builder, ts[0], s, types.intp, _strided(context, builder, i_, ts[1], si_, ts[2], r)),
                align=4,
            )
            for r in range(LANES)
        ]
        for c, v in enumerate(_transpose_lanes(builder, rows)):
            at = _strided(context, builder, j_, ts[4], dj_, ts[5], c)
            builder.store(v, _vec_ptr(context, builder, ts[3], d, types.intp, at), align=4)
        return context.get_dummy_value()

    return types.none(src, i, si, dst, j, dj), codegen


def _byte_vec_ptr(context, builder, aryty, ary, offty, off, elt):
    """Pointer to LANES elements of type elt at byte offset off from the array's data pointer
    (any layout: the caller computes the offset from its strides)."""
    a = context.make_array(aryty)(context, builder, ary)
    o = context.cast(builder, off, offty, types.intp)
    p = builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [o])
    return builder.bitcast(p, ir.VectorType(elt, LANES).as_pointer())


@intrinsic
def vload_f16_at(typingctx, a, off):
    """16 f16 values at byte offset off of a's data (any array; no bounds check), as float32."""
    if not (isinstance(a, types.Array) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_byte_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], ir.HalfType()))
        return builder.fpext(v, _VF)

    return f32vec(a, off), codegen


@intrinsic
def vtranspose16_f16(typingctx, src, off, stride, dst, j, dj):
    """dst[j + c * dj + r] = the f16 value c of the 16 at byte offset off + r * stride of src's data,
    as float32, for r, c < 16: 16 f16 rows widened and transposed by shuffles (values exact)."""
    if not (
        isinstance(src, types.Array)
        and isinstance(dst, types.Array)
        and dst.dtype == types.float32
        and all(isinstance(x, types.Integer) for x in (off, stride, j, dj))
    ):
        return None

    def codegen(context, builder, sig, args):
        s, off_, st_, d, j_, dj_ = args
        ts = sig.args

        rows = [
            builder.fpext(
                builder.load(
                    _byte_vec_ptr(
                        context,
                        builder,
                        ts[0],
                        s,
                        types.intp,
                        _strided(context, builder, off_, ts[1], st_, ts[2], r),
                        ir.HalfType(),
                    )
                ),
                _VF,
            )
            for r in range(LANES)
        ]
        for c, v in enumerate(_transpose_lanes(builder, rows)):
            at = _strided(context, builder, j_, ts[4], dj_, ts[5], c)
            builder.store(v, _vec_ptr(context, builder, ts[3], d, types.intp, at), align=4)
        return context.get_dummy_value()

    return types.none(src, off, stride, dst, j, dj), codegen
