"""Explicit integer vectors for the block dot products of kernels/qdot.py, one code per CPU path.

A ``B64`` value is an LLVM ``<64 x i8>`` (64 weight bytes: 16 rows x 4 consecutive values), an
``I32x16`` an ``<16 x i32>`` (one 32-bit sum per row). ``idot(isa, acc, w, xw)`` adds to each
lane r the dot product of its four weight bytes w[4r .. 4r+3] (unsigned, <= 63 unless the
weights are signed, see below) with the four signed activation bytes packed in the i32 ``xw``.

The first argument names the instruction path, as a numba type (``IsaType``), so that every
path is a separate compiled specialization and a separate numba cache entry:
- ``vnni512``: ``vpdpbusd`` on zmm registers (AVX512-VNNI);
- ``vnni256``: ``vpdpbusd`` on two ymm halves (AVX-VNNI, or AVX512-VNNI with VL);
- ``avx2``: ``pmaddubsw`` + ``pmaddwd`` on two ymm halves (no VNNI);
- ``portable``: widening multiplies and adds in plain LLVM vector IR (any CPU).
All four give the same integers (the sums are exact; unsigned weights <= 63 times activations
in -127..127 cannot saturate pmaddubsw's 16-bit pair sums).

Signed weights (q8_0, iq4_nl: -128..127) are the one case where the paths differ inside:
``idot_s`` returns sum((w + c) * x) with ``c = s8_bias(isa)`` — 128 on the VNNI paths (the
weight bytes are flipped to w + 128 to be vpdpbusd's unsigned operand), 0 on avx2 (|w| and the
sign moved onto x, ggml's trick) and portable — and the caller subtracts c * sum(x), so the
block's integer is again the same on every path.

Loads take an array and a flat element index (C-contiguous; no bounds check).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox

from kvchat.kernels.simd import F32Vec, f32vec

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_VB = ir.VectorType(_I8, 64)
_VI = ir.VectorType(_I32, 16)
_VF = ir.VectorType(ir.FloatType(), 16)

ISA_NAMES = ("vnni512", "vnni256", "avx2", "portable")


class Isa:
    """A CPU path for the integer kernels (Python side; numba sees it as IsaType(name))."""

    def __init__(self, name: str):
        if name not in ISA_NAMES:
            raise ValueError(f"unknown integer kernel path '{name}'; one of {', '.join(ISA_NAMES)}")
        self.name = name
        self._numba_type_ = IsaType(name)  # read by numba's dispatcher instead of typeof (13 -> 0.6 µs)

    def __repr__(self) -> str:
        return f"Isa({self.name})"


class IsaType(types.Dummy):
    def __init__(self, name: str):
        self.isa = name
        super().__init__(name=f"isa_{name}")


@typeof_impl.register(Isa)
def _typeof_isa(val, c):
    return IsaType(val.name)


register_model(IsaType)(models.OpaqueModel)


@unbox(IsaType)
def _unbox_isa(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


class B64(types.Type):
    def __init__(self):
        super().__init__(name="i8x64")


class I32x16(types.Type):
    def __init__(self):
        super().__init__(name="i32x16")


b64 = B64()
i32x16 = I32x16()


@register_model(B64)
class _B64Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VB)


@register_model(I32x16)
class _I32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _ptr(context, builder, aryty, ary, idxty, idx, vty):
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(a.data, [i]), vty.as_pointer())


def _const(vty, v, n):
    return ir.Constant(vty, [v] * n)


@intrinsic
def bload(typingctx, a, i):
    """Bytes i .. i+63 of a u8 or i8 array."""
    if not (isinstance(a, types.Array) and a.dtype in (types.uint8, types.int8) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _VB), align=1)

    return b64(a, i), codegen


@intrinsic
def bstore(typingctx, a, i, v):
    """Bytes i .. i+63 of a u8 array = v."""
    if not (isinstance(a, types.Array) and a.dtype == types.uint8 and isinstance(i, types.Integer) and v == b64):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _VB), align=1)
        return context.get_dummy_value()

    return types.none(a, i, v), codegen


@intrinsic
def blo(typingctx, v):
    """Low nibble of each byte (0..15)."""
    if v != b64:
        return None

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _const(_VB, 15, 64))

    return b64(v), codegen


@intrinsic
def bhi(typingctx, v):
    """High nibble of each byte (0..15)."""
    if v != b64:
        return None

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _const(_VB, 4, 64))

    return b64(v), codegen


@intrinsic
def bplane(typingctx, v, a, i, bit):
    """v | (bit where a bit-plane word is set): the 64 bits of the little-endian u64 at bytes
    i .. i+7 of the u8 array a, bit b set -> byte b of v gets ``bit`` (16 or 32: the fifth or
    sixth bit of a 5- / 6-bit weight, kernels/qlayout.py). kmov + masked move on AVX512-BW."""
    if not (
        v == b64
        and isinstance(a, types.Array)
        and a.dtype in (types.uint8, types.int8)
        and isinstance(i, types.Integer)
        and isinstance(bit, types.Integer)
    ):
        return None

    def codegen(context, builder, sig, args):
        w = builder.load(_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2], ir.IntType(64)), align=1)
        mask = builder.bitcast(w, ir.VectorType(ir.IntType(1), 64))
        b = builder.trunc(context.cast(builder, args[3], sig.args[3], types.int64), _I8)
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(_VB, ir.Undefined), b, ir.Constant(_I32, 0)),
            ir.Constant(_VB, ir.Undefined),
            ir.Constant(ir.VectorType(_I32, 64), [0] * 64),
        )
        return builder.or_(args[0], builder.select(mask, splat, ir.Constant(_VB, None)))

    return b64(v, a, i, bit), codegen


@intrinsic
def bmerge(typingctx, v, w, sh, mask):
    """v | ((w << sh) & mask) per byte, sh a constant (negative: a right shift by -sh): a byte's
    high value bits taken from a vector that holds them packed (q6_K's crumbs, kernels/qlayout.py).
    The shift runs on 16-bit lanes (AVX2 has no byte shift); the bits it carries across a byte
    boundary land outside ``mask``, which must keep only bits the shift moved within the byte."""
    if not (v == b64 and w == b64 and isinstance(sh, types.IntegerLiteral) and isinstance(mask, types.IntegerLiteral)):
        return None
    s, mk = sh.literal_value, mask.literal_value
    carried = (1 << s) - 1 if s >= 0 else 0xFF & ~((1 << (8 + s)) - 1)  # result bits from the next byte
    if not (-7 <= s <= 7 and 0 <= mk <= 255 and mk & carried == 0):
        return None
    vw = ir.VectorType(_I16, 32)

    def codegen(context, builder, sig, args):
        x = args[1]
        if s != 0:
            x16 = builder.bitcast(x, vw)
            x16 = builder.shl(x16, _const(vw, s, 32)) if s > 0 else builder.lshr(x16, _const(vw, -s, 32))
            x = builder.bitcast(x16, _VB)
        return builder.or_(args[0], builder.and_(x, _const(_VB, mk, 64)))

    return b64(v, w, sh, mask), codegen


@intrinsic
def blut(typingctx, isa, fmt, v):
    """Each byte of v (a nibble, 0..15) replaced by entry v of fmt's 16-byte table (QFormat.lut:
    mxfp4's values, kernels/qlayout.py); v itself when the format has no table. One pshufb per
    32 bytes on avx2 / AVX-VNNI (a table per 128-bit lane), one on 64 bytes on AVX512; the
    portable path selects entry by entry."""
    lut = getattr(getattr(fmt, "fmt", None), "lut", None)
    if not (isinstance(isa, IsaType) and v == b64 and lut is not None):
        return None
    path = isa.isa

    def codegen(context, builder, sig, args):
        w = args[2]
        if not lut:
            return w
        if path == "vnni512":
            table = ir.Constant(_VB, list(lut) * 4)
            return _call(builder, "llvm.x86.avx512.pshuf.b.512", _VB, [_VB, _VB], [table, w])
        if path in ("vnni256", "avx2"):
            vb32 = ir.VectorType(_I8, 32)
            table = ir.Constant(vb32, list(lut) * 2)
            halves = [builder.bitcast(h, vb32) for h in _split(builder, builder.bitcast(w, _VI), 16, 2)]
            out = [_call(builder, "llvm.x86.avx2.pshuf.b", vb32, [vb32, vb32], [table, h]) for h in halves]
            return _join(builder, out[0], out[1], 32)
        out = ir.Constant(_VB, None)
        for j, value in enumerate(lut):
            hit = builder.icmp_unsigned("==", w, _const(_VB, j, 64))
            out = builder.select(hit, _const(_VB, value, 64), out)
        return out

    return b64(isa, fmt, v), codegen


@intrinsic
def izero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, None)

    return i32x16(), codegen


@intrinsic
def ibcast(typingctx, x):
    """An integer scalar (as i32) in all 16 lanes."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int32)
        vec = builder.insert_element(ir.Constant(_VI, ir.Undefined), v, ir.Constant(_I32, 0))
        return builder.shuffle_vector(vec, ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * 16))

    return i32x16(x), codegen


def _binop(name):
    @intrinsic
    def op(typingctx, a, b):
        if not (a == b == i32x16):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, name)(args[0], args[1])

        return i32x16(a, b), codegen

    return op


iadd = _binop("add")
isub = _binop("sub")
imul = _binop("mul")


@intrinsic
def iload8(typingctx, a, i):
    """Elements i .. i+15 of an i8 / u8 array, widened to i32 (sign / zero extended)."""
    if not (isinstance(a, types.Array) and a.dtype in (types.int8, types.uint8) and isinstance(i, types.Integer)):
        return None
    signed = a.dtype == types.int8

    def codegen(context, builder, sig, args):
        v = builder.load(
            _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], ir.VectorType(_I8, 16)), align=1
        )
        return builder.sext(v, _VI) if signed else builder.zext(v, _VI)

    return i32x16(a, i), codegen


@intrinsic
def itof(typingctx, v):
    """Each lane converted to float32 (exact below 2^24)."""
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)

    return f32vec(v), codegen


def _split(builder, v, n, parts):
    """A vector of n lanes -> `parts` vectors of n / parts lanes."""
    w = n // parts
    return [
        builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w), list(range(p * w, (p + 1) * w))))
        for p in range(parts)
    ]


def _join(builder, a, b, n):
    """Two vectors of n lanes -> one of 2n."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _xbytes(builder, xw):
    """The i32 holding 4 activation bytes, repeated in all 16 lanes, as <64 x i8>."""
    vec = builder.insert_element(ir.Constant(_VI, ir.Undefined), xw, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(vec, ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * 16)), _VB)


def _call(builder, name, ret, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)
    return builder.call(fn, args)


def _dot_codegen(isa: str, signed_w: bool):
    """acc + per lane sum of 4 products: weights <64 x i8> (u8 <= 63, or s8 when signed_w) x
    activations <64 x i8> s8 -> <16 x i32>."""

    def gen(builder, acc, w, x):
        if isa in ("vnni512", "vnni256"):
            if signed_w:  # vpdpbusd wants unsigned weights: w + 128 (the caller subtracts 128 * sum x)
                w = builder.xor(w, _const(_VB, -128, 64))
            if isa == "vnni512":
                return _call(
                    builder,
                    "llvm.x86.avx512.vpdpbusd.512",
                    _VI,
                    [_VI, _VI, _VI],
                    [acc, builder.bitcast(w, _VI), builder.bitcast(x, _VI)],
                )
            v8 = ir.VectorType(_I32, 8)
            accs = _split(builder, acc, 16, 2)
            ws = _split(builder, builder.bitcast(w, _VI), 16, 2)
            xs = _split(builder, builder.bitcast(x, _VI), 16, 2)
            r = [
                _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8], [accs[h], ws[h], xs[h]])
                for h in range(2)
            ]
            return _join(builder, r[0], r[1], 8)
        if isa == "avx2":
            vb32, vw16, v8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
            accs = _split(builder, acc, 16, 2)
            ws = [builder.bitcast(h, vb32) for h in _split(builder, builder.bitcast(w, _VI), 16, 2)]
            xs = [builder.bitcast(h, vb32) for h in _split(builder, builder.bitcast(x, _VI), 16, 2)]
            ones = ir.Constant(vw16, [1] * 16)
            out = []
            for h in range(2):
                wh, xh = ws[h], xs[h]
                if signed_w:  # |w| as the unsigned operand, w's sign moved onto x (|w| <= 128, |x| <= 127)
                    xh = _call(builder, "llvm.x86.avx2.psign.b", vb32, [vb32, vb32], [xh, wh])
                    wh = _call(
                        builder, "llvm.abs.v32i8", vb32, [vb32, ir.IntType(1)], [wh, ir.Constant(ir.IntType(1), 0)]
                    )
                p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", vw16, [vb32, vb32], [wh, xh])
                p32 = _call(builder, "llvm.x86.avx2.pmadd.wd", v8, [vw16, vw16], [p16, ones])
                out.append(builder.add(accs[h], p32))
            return _join(builder, out[0], out[1], 8)
        # portable: widen to i32, multiply, add the four products of each lane
        v64 = ir.VectorType(_I32, 64)
        wi = builder.sext(w, v64) if signed_w else builder.zext(w, v64)
        p = builder.mul(wi, builder.sext(x, v64))
        for i in range(4):
            acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(_VI, [4 * r + i for r in range(16)])))
        return acc

    return gen


def _make_dot(signed_w: bool):
    @intrinsic
    def dot(typingctx, isa, acc, w, xw):
        if not (isinstance(isa, IsaType) and acc == i32x16 and w == b64 and isinstance(xw, types.Integer)):
            return None
        gen = _dot_codegen(isa.isa, signed_w)

        def codegen(context, builder, sig, args):
            x = _xbytes(builder, context.cast(builder, args[3], sig.args[3], types.int32))
            return gen(builder, args[1], args[2], x)

        return i32x16(isa, acc, w, xw), codegen

    return dot


idot = _make_dot(False)
idot.__doc__ = "acc + per row dot of 4 unsigned weight bytes (<= 63) with the 4 activation bytes of xw."
idot_s = _make_dot(True)
idot_s.__doc__ = "acc + per row dot of 4 signed weight bytes plus s8_bias(isa) with the 4 activation bytes of xw."


@intrinsic
def s8_bias(typingctx, isa):
    """The c of idot_s on this path: 128 on VNNI (weights flipped to unsigned), else 0."""
    if not isinstance(isa, IsaType):
        return None
    c = 128 if isa.isa in ("vnni512", "vnni256") else 0

    def codegen(context, builder, sig, args):
        return ir.Constant(_I32, c)

    return types.int32(isa), codegen


@intrinsic
def prefetch(typingctx, a, i):
    """A hint to bring the cache line holding element i of array a into L1 (llvm.prefetch: read,
    locality 3, data; prefetcht0 on x86). No fault and no effect on results, also past a's end."""
    if not (isinstance(a, types.Array) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _I8)
        i32 = ir.IntType(32)
        _call(
            builder,
            "llvm.prefetch.p0i8",
            ir.VoidType(),
            [p.type, i32, i32, i32],
            [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)],
        )
        return context.get_dummy_value()

    return types.none(a, i), codegen


__all__ = [
    "Isa",
    "IsaType",
    "ISA_NAMES",
    "F32Vec",
    "bload",
    "bstore",
    "bplane",
    "bmerge",
    "blo",
    "bhi",
    "blut",
    "izero",
    "ibcast",
    "iadd",
    "isub",
    "imul",
    "iload8",
    "itof",
    "idot",
    "idot_s",
    "s8_bias",
    "prefetch",
]
