"""Float formats inside numba: f32, f16 and bf16 rows, and bit-exact half/bf16 conversion.

numba has no usable float16 scalar type, so half and bfloat16 values travel as uint16 bit
patterns and are converted here with integer arithmetic only: the results are the ones
ggml's reference conversions give (ggml-impl.h) — round to nearest even, subnormals kept,
overflow to inf, NaN kept as a quiet NaN — and fastmath cannot alter them (no float ops).
Rows are little-endian bytes, as in GGUF files and the KV cache.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def bits_to_f32(typingctx, u):
    """Reinterpret a uint32 bit pattern as float32 (no conversion, one register move)."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_bits(typingctx, f):
    """Reinterpret a float32 as its uint32 bit pattern."""
    if not isinstance(f, types.Float):
        return None
    sig = types.uint32(f)

    def codegen(context, builder, signature, args):
        v = args[0]
        if isinstance(v.type, ir.DoubleType):
            v = builder.fptrunc(v, ir.FloatType())
        return builder.bitcast(v, ir.IntType(32))

    return sig, codegen


@njit(cache=True)
def f16_to_f32(h):
    """IEEE half bit pattern (uint16) -> float32, exact for every input."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0x1F:  # inf, or NaN with its payload, made quiet as a float op would
        bits = sign | 0x7F800000 | (man << 13) | (0x400000 if man != 0 else 0)
    elif exp != 0:  # normal: rebias 15 -> 127
        bits = sign | ((exp + 112) << 23) | (man << 13)
    elif man == 0:  # signed zero
        bits = sign
    else:  # subnormal half is a normal float: shift the leading 1 into the hidden bit
        e = 113
        while (man & 0x400) == 0:
            man <<= 1
            e -= 1
        bits = sign | (e << 23) | ((man & 0x3FF) << 13)
    return bits_to_f32(np.uint32(bits))


@njit(cache=True)
def f32_to_f16(f):
    """float32 -> IEEE half bit pattern (uint16), round to nearest even like ggml."""
    x = np.int64(f32_to_bits(np.float32(f)))
    sign = (x >> 16) & 0x8000
    ax = x & 0x7FFFFFFF
    if ax > 0x7F800000:  # NaN -> the canonical quiet NaN, as ggml
        return np.uint16(sign | 0x7E00)
    if ax >= 0x477FF000:  # >= 65520 rounds past the largest half (65504)
        return np.uint16(sign | 0x7C00)
    if ax >= 0x38800000:  # normal half (>= 2^-14): rebias, round 13 dropped bits to even
        m = ax - 0x38000000
        return np.uint16(sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13))
    if ax <= 0x33000000:  # <= 2^-25 (the tie rounds to even zero)
        return np.uint16(sign)
    # subnormal half: value in units of 2^-24 = mantissa >> shift, rounded to even
    e = ax >> 23
    mant = (ax & 0x7FFFFF) | 0x800000
    shift = 126 - e
    r = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (r & 1) == 1):
        r += 1
    return np.uint16(sign | r)


@njit(cache=True)
def bf16_to_f32(h):
    """bfloat16 bit pattern -> float32 (the upper half of the float's bits)."""
    return bits_to_f32(np.uint32((np.int64(h) & 0xFFFF) << 16))


@njit(cache=True)
def f32_to_bf16(f):
    """float32 -> bfloat16 bit pattern: round to nearest even, NaN forced quiet (as ggml)."""
    x = np.int64(f32_to_bits(np.float32(f)))
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((x >> 16) | 64)
    return np.uint16((x + 0x7FFF + ((x >> 16) & 1)) >> 16)


@njit(cache=True)
def read_f16(src, o):
    """The half stored little-endian at src[o:o+2], as float32."""
    return f16_to_f32(np.int64(src[o]) | (np.int64(src[o + 1]) << 8))


@njit(cache=True)
def write_f16(dst, o, v):
    """Store float32 v as a little-endian half at dst[o:o+2]."""
    h = np.int64(f32_to_f16(v))
    dst[o] = np.uint8(h & 0xFF)
    dst[o + 1] = np.uint8(h >> 8)


@njit(cache=True)
def read_f32(src, o):
    """The float32 stored little-endian at src[o:o+4]."""
    u = np.int64(src[o]) | (np.int64(src[o + 1]) << 8) | (np.int64(src[o + 2]) << 16) | (np.int64(src[o + 3]) << 24)
    return bits_to_f32(np.uint32(u))


# ---- rows: src u8[row_bytes], dst f32[n] (or the reverse) ----------------------------------


@njit(cache=True, fastmath=True)
def dequant_row_f32(src, dst):
    for i in range(dst.shape[0]):  # dst [n] f32, src [4n] u8
        dst[i] = read_f32(src, 4 * i)


@njit(cache=True)
def quant_row_f32(src, dst):
    for i in range(src.shape[0]):  # src [n] f32, dst [4n] u8
        u = np.int64(f32_to_bits(src[i]))
        dst[4 * i] = np.uint8(u & 0xFF)
        dst[4 * i + 1] = np.uint8((u >> 8) & 0xFF)
        dst[4 * i + 2] = np.uint8((u >> 16) & 0xFF)
        dst[4 * i + 3] = np.uint8(u >> 24)


@njit(cache=True, fastmath=True)
def dequant_row_f16(src, dst):
    for i in range(dst.shape[0]):  # dst [n] f32, src [2n] u8
        dst[i] = read_f16(src, 2 * i)


@njit(cache=True)
def quant_row_f16(src, dst):
    for i in range(src.shape[0]):  # src [n] f32, dst [2n] u8
        write_f16(dst, 2 * i, src[i])


@njit(cache=True, fastmath=True)
def dequant_row_bf16(src, dst):
    for i in range(dst.shape[0]):  # dst [n] f32, src [2n] u8
        dst[i] = bf16_to_f32(np.int64(src[2 * i]) | (np.int64(src[2 * i + 1]) << 8))


@njit(cache=True)
def quant_row_bf16(src, dst):
    for i in range(src.shape[0]):  # src [n] f32, dst [2n] u8
        h = np.int64(f32_to_bf16(src[i]))
        dst[2 * i] = np.uint8(h & 0xFF)
        dst[2 * i + 1] = np.uint8(h >> 8)
