"""Scalar float32 math in the exact operation order of ggml-cpu's x86 build, for the form of it
that llama.cpp runs on this CPU.

llama.cpp computes SiLU (and the softmax of its attention) with its own vectorized exp,
``ggml_v_expf`` (vec.h): a range reduction by 2^n with n = round(x / ln 2), a degree-5
polynomial in fused multiply-adds, and a scaling by 2^n; libm's expf differs from it in the last
bit for a good share of inputs. vec.h has one form per instruction set, and they round
differently (about one value in eight in the last bit, #24):
- AVX-512 (``_mm512_scalef_ps``): j = 1 + poly(b), rounded, then j * 2^n (``expf_ggml_avx512``);
- AVX2 + FMA: j = poly(b) without the 1, then one fma(j, 2^n, 2^n); past |n| > 126 a two-step
  scaling (``expf_ggml_avx2``).
``expf_ggml`` is the form of this host (AVX512F + AVX512DQ: the AVX-512 one, else the AVX2 one;
ggml's SSE2-only form is not mirrored), fixed when the kernels compile: numba keys its cache on
the host CPU's features, so a cache never carries one machine's form to another. ``fma32`` is
LLVM's ``llvm.fma.f32`` (one rounding; an FMA instruction on this CPU, libm's fmaf elsewhere).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvchat.kernels.cpu import host_features


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c for float32 values, rounded once."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f] * 3), "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen


_R = np.float32(float.fromhex('0x1.8p23'))  # adding it rounds to an integer
_LOG2E = np.float32(float.fromhex('0x1.715476p+0'))
_LN2_HI = np.float32(float.fromhex('0x1.62e4p-1'))
_LN2_LO = np.float32(float.fromhex('0x1.7f7d1cp-20'))
_C5 = np.float32(float.fromhex('0x1.0e4020p-7'))
_C4 = np.float32(float.fromhex('0x1.573e2ep-5'))
_C3 = np.float32(float.fromhex('0x1.555e66p-3'))
_C2 = np.float32(float.fromhex('0x1.fffdb6p-2'))
_C1 = np.float32(float.fromhex('0x1.ffffecp-1'))
_ONE = np.float32(1.0)


_R_BITS = 0x4B400000  # the bits of _R: 2^23 + 2^22


@intrinsic
def scale_by_pow2(typingctx, j, z):
    """j * 2^n rounded once, for n = z - 0x1.8p23 with |n| <= 192, from z's bits.

    z = x log2(e) + 0x1.8p23 lies in [2^23, 2^24) when |n| < 2^22, so its low mantissa bits
    hold n + 2^22 and bits(z) - bits(0x1.8p23) = n. 2^n is built as 2^(n >> 1) * 2^(n - (n >> 1)):
    both factors are normal floats for |n| <= 192, j * 2^(n >> 1) is exact (j is near 1), and
    the second product rounds once — the value scalef(j, n) gives, overflow to inf and
    subnormal results included. Integer and float operations only (no ldexp call), so a loop
    over it vectorizes. For |n| > 192 the result is meaningless and expf_ggml discards it.
    """
    if not (j == z == types.float32):
        return None

    def codegen(context, builder, sig, args):
        fj, fz = args
        i32, f32 = ir.IntType(32), ir.FloatType()
        n = builder.sub(builder.bitcast(fz, i32), ir.Constant(i32, _R_BITS))
        n1 = builder.ashr(n, ir.Constant(i32, 1))
        n2 = builder.sub(n, n1)

        def pow2(k):
            return builder.bitcast(builder.shl(builder.add(k, ir.Constant(i32, 127)), ir.Constant(i32, 23)), f32)

        return builder.fmul(builder.fmul(fj, pow2(n1)), pow2(n2))

    return types.float32(j, z), codegen


@njit(cache=True, inline="always")
def expf_ggml_avx512(x):
    """e^x of a float32 as ggml_v_expf's AVX-512 form computes it, lane by lane. Branch-free
    (the saturation is a select), so loops over it vectorize."""
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, _ONE))
    res = scale_by_pow2(j, z)  # scalef(j, n)
    alt = np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
    return alt if abs(n) > np.float32(192.0) else res


@intrinsic
def _shl23_add(typingctx, z, c):
    """The float32 whose bits are (bits(z) << 23) + c in 32-bit integer arithmetic (wrapping), as
    vec.h's _mm256_slli_epi32 / _mm256_add_epi32 on z's bits: 32-bit lanes only, so a loop over
    it vectorizes at full width (numba's own integer promotion would widen to 64 bits)."""
    if not (z == types.float32 and c == types.uint32):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        e = builder.shl(builder.bitcast(args[0], i32), ir.Constant(i32, 23))
        return builder.bitcast(builder.add(e, args[1]), ir.FloatType())

    return types.float32(z, c), codegen


_TWO_127 = np.float32(2.0**127)  # bits 0x7f000000: vec.h's s1 for n > 0
_TWO_M125 = np.float32(2.0**-125)  # bits 0x01000000 (0x82000000 + 0x7f000000): s1 for n <= 0


@njit(cache=True, inline="always")
def expf_ggml_avx2(x):
    """e^x of a float32 as ggml_v_expf's AVX2 form computes it, lane by lane: k = 2^n from z's
    bits, j = poly(b) (no 1 added), fma(j, k, k); where |n| > 126 (2^n is no normal float) it
    is fma(s2, j, s2) * s1 with 2^n = s1 * s2, s1 = 2^127 (n > 0) or 2^-125, and s1 * s1 (inf or
    0) past |n| > 192, as vec.h selects them. Branch-free (selects), so loops over it vectorize."""
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    k = _shl23_add(z, np.uint32(0x3F800000))  # e + bits(1.0f)
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, _C1 * b)
    neg = n <= np.float32(0.0)
    s1 = _TWO_M125 if neg else _TWO_127
    s2 = _shl23_add(z, np.uint32(0x7E000000) if neg else np.uint32(0))  # e - g, g = 0x82000000 or 0
    big = s1 * s1 if abs(n) > np.float32(192.0) else fma32(s2, j, s2) * s1
    return big if abs(n) > np.float32(126.0) else fma32(j, k, k)


EXPF_AVX512 = {"avx512f", "avx512dq"} <= host_features()  # ggml's AVX-512 exp (else its AVX2 one)


@njit(cache=True, inline="always")
def expf_ggml(x):
    """e^x of a float32 as llama.cpp's ggml_v_expf computes it on this CPU (module docstring)."""
    if EXPF_AVX512:
        return expf_ggml_avx512(x)
    return expf_ggml_avx2(x)


@njit(cache=True, inline="always")
def silu_ggml(x):
    """ggml_v_silu: x / (1 + e^(0 - x)) with expf_ggml."""
    return x / (_ONE + expf_ggml(np.float32(0.0) - x))


def _vexp_codegen(builder, x, avx512):
    """expf_ggml_avx512 / expf_ggml_avx2 on 16 lanes, operation for operation (IR)."""
    from kvchat.kernels.simd import LANES

    vf = ir.VectorType(ir.FloatType(), LANES)
    vi = ir.VectorType(ir.IntType(32), LANES)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{LANES}f32")
    fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.fabs.v{LANES}f32")

    def c(v):
        return ir.Constant(vf, [float(np.float32(v))] * LANES)

    def ci(v):
        return ir.Constant(vi, [v] * LANES)

    def f(a, b, cc):
        return builder.call(fma, [a, b, cc])

    z = f(x, c(_LOG2E), c(_R))
    n = builder.fsub(z, c(_R))
    nn = builder.fneg(n)
    b = f(nn, c(_LN2_LO), f(nn, c(_LN2_HI), x))
    u = builder.fmul(b, b)
    absn = builder.call(fabs, [n])
    neg = builder.fcmp_ordered("<=", n, c(0.0))
    zi = builder.bitcast(z, vi)
    if avx512:
        j = f(f(f(c(_C5), b, c(_C4)), u, f(c(_C3), b, c(_C2))), u, f(c(_C1), b, c(_ONE)))
        ni = builder.sub(zi, ci(_R_BITS))
        n1 = builder.ashr(ni, ci(1))
        n2 = builder.sub(ni, n1)

        def pow2(k):
            return builder.bitcast(builder.shl(builder.add(k, ci(127)), ci(23)), vf)

        res = builder.fmul(builder.fmul(j, pow2(n1)), pow2(n2))
        alt = builder.select(neg, c(0.0), c(np.inf))
        return builder.select(builder.fcmp_ordered(">", absn, c(192.0)), alt, res)
    k = builder.bitcast(builder.add(builder.shl(zi, ci(23)), ci(0x3F800000)), vf)
    j = f(f(f(c(_C5), b, c(_C4)), u, f(c(_C3), b, c(_C2))), u, builder.fmul(c(_C1), b))
    s1 = builder.select(neg, c(_TWO_M125), c(_TWO_127))
    s2 = builder.bitcast(builder.add(builder.shl(zi, ci(23)), builder.select(neg, ci(0x7E000000), ci(0))), vf)
    big = builder.select(
        builder.fcmp_ordered(">", absn, c(192.0)), builder.fmul(s1, s1), builder.fmul(f(s2, j, s2), s1)
    )
    return builder.select(builder.fcmp_ordered(">", absn, c(126.0)), big, f(j, k, k))


def _vexp_intrinsic(avx512):
    def typer(typingctx, v):
        from kvchat.kernels.simd import f32vec

        if v != f32vec:
            return None

        def codegen(context, builder, sig, args):
            return _vexp_codegen(builder, args[0], avx512)

        return f32vec(v), codegen

    typer.__name__ = typer.__qualname__ = "vexpf_ggml_avx512" if avx512 else "vexpf_ggml_avx2"
    return intrinsic(typer)


vexpf_ggml_avx512 = _vexp_intrinsic(True)  # expf_ggml_avx512 on 16 lanes, every lane the scalar's bits
vexpf_ggml_avx2 = _vexp_intrinsic(False)  # expf_ggml_avx2 on 16 lanes, likewise


@njit(cache=True, inline="always")
def vexpf_ggml(v):
    """expf_ggml on the 16 lanes of a kernels/simd vector (the same operations, selects for its
    selects): ggml_v_expf of this CPU as ggml runs it, vectorized."""
    if EXPF_AVX512:
        return vexpf_ggml_avx512(v)
    return vexpf_ggml_avx2(v)
