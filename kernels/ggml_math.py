"""Scalar float32 math in the exact operation order of ggml-cpu's x86 (AVX-512) build.

llama.cpp computes SiLU (and the softmax of its attention) with its own vectorized exp,
``ggml_v_expf`` (vec.h): a range reduction by 2^n with n = round(x / ln 2), a degree-5
polynomial in fused multiply-adds, and an exact scaling by 2^n (``_mm512_scalef_ps``); libm's
expf differs from it in the last bit for a good share of inputs. ``expf_ggml`` is that sequence
on one value; ``fma32`` is LLVM's ``llvm.fma.f32`` (one rounding; an FMA instruction on this
CPU, libm's fmaf elsewhere), so the result is the same on every CPU path.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


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


@njit(cache=True, forceinline=True)
def expf_ggml(x):
    """e^x of a float32 as ggml_v_expf (AVX-512 form) computes it, lane by lane. Branch-free
    (the saturation is a select), so loops over it vectorize."""
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, _ONE))
    res = scale_by_pow2(j, z)  # scalef(j, n)
    alt = np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
    return alt if abs(n) > np.float32(192.0) else res


@njit(cache=True, forceinline=True)
def silu_ggml(x):
    """ggml_v_silu: x / (1 + e^(0 - x)) with expf_ggml."""
    return x / (_ONE + expf_ggml(np.float32(0.0) - x))
