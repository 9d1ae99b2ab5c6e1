"""Scalar float32 math in the exact operation order of ggml-cpu's x86 (AVX-512) build.

llama.cpp computes SiLU (and the softmax of its attention) with its own vectorized exp,
``ggml_v_expf`` (vec.h): a range reduction by 2^n with n = round(x / ln 2), a degree-5
polynomial in fused multiply-adds, and an exact scaling by 2^n (``_mm512_scalef_ps``); libm's
expf differs from it in the last bit for a good share of inputs. ``expf_ggml`` is that sequence
on one value; ``fma32`` is LLVM's ``llvm.fma.f32`` (one rounding; an FMA instruction on this
CPU, libm's fmaf elsewhere), so the result is the same on every CPU path.
"""
from __future__ import annotations

import math

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


@njit(cache=True, inline="always")
def expf_ggml(x):
    """e^x of a float32 as ggml_v_expf (AVX-512 form) computes it, lane by lane."""
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    if abs(n) > np.float32(192.0):
        return np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, _ONE))
    # scalef(j, n) = j * 2^n, rounded once (exact in float64, then one rounding to float32)
    return np.float32(math.ldexp(np.float64(j), int(n)))


@njit(cache=True, inline="always")
def silu_ggml(x):
    """ggml_v_silu: x / (1 + e^(0 - x)) with expf_ggml."""
    return x / (_ONE + expf_ggml(np.float32(0.0) - x))
