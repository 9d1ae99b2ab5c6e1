"""GELU as ggml's CPU backend computes it: through its f16 table (GGML_GELU_FP16, ggml-cpu/vec.h).

ggml's CPU GELU and GeGLU on f32 (gemma2, gemma3: LLM_FFN_GELU, PAR) do not evaluate the tanh
formula per value: for -10 < x < 10 they round x to f16 and read a 65536-entry table holding
f16(gelu(half)), so y = f16(gelu(f16(x))); x <= -10 gives 0 and x >= 10 gives x. ggml_cpu_init
fills that table with ggml_gelu_f32 as GCC compiles it for x86: `1 + GELU_COEF_A*x*x` is
contracted to one fma (GCC's default -ffp-contract=fast), and libm's tanhf. `_gelu_ggml_f32`
is that expression; without the fma one entry of the 37376 that are read (x = -1.999) is a
half step off llama.cpp's.

The lookup is branch-free (the f16 index is integer / float arithmetic, the saturation a
select), so LLVM vectorizes the GeGLU loop, where a libm tanhf per value kept it scalar.
Element-wise, so a row's result does not depend on the batch.
"""

import math

import numpy as np
from numba import njit

from kvchat.kernels.ggml_math import fma32
from kvchat.kernels.quants_fp import bits_to_f32, f16_to_f32, f32_to_bits, f32_to_f16

_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_COEF_A = np.float32(0.044715)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_TEN_BITS = np.uint32(0x41200000)  # bits of 10.0f: |x| < 10 <=> (bits & 0x7fffffff) < this (NaN not)


@njit(cache=True, inline="always")
def _gelu_ggml_f32(x):
    """ggml_gelu_f32 with GCC's contraction: 0.5 x (1 + tanhf(sqrt(2/pi) x fma(a x, x, 1)))."""
    inner = _SQRT_2_OVER_PI * x * fma32(_GELU_COEF_A * x, x, _ONE)
    return _HALF * x * (_ONE + np.float32(math.tanh(inner)))


@njit(cache=True)
def _build_table(out):
    """out [65536] f32 <- the f16 value f16(gelu(half i)), as ggml_cpu_init fills ggml_table_gelu_f16."""
    for i in range(65536):
        out[i] = f16_to_f32(f32_to_f16(_gelu_ggml_f32(f16_to_f32(np.uint16(i)))))


_TABLE = np.empty(65536, dtype=np.float32)  # [65536] f32, filled on first use
_READY = [False]


def gelu_table() -> np.ndarray:
    """ggml's GELU table as f32 values, [65536] indexed by the f16 bit pattern of x."""
    if not _READY[0]:
        _build_table(_TABLE)
        _READY[0] = True
    return _TABLE


@njit(cache=True, inline="always")
def f16_index(b):
    """The f16 bit pattern of the float32 with bits b (uint32), rounded to nearest even, for
    finite |x| < 65504 — ggml's GGML_CPU_FP32_TO_FP16 (vcvtps2ph, round to nearest). Branch-free:
    a normal half drops 13 mantissa bits with a round-half-even carry; below 2^-14 the float
    sum |x| + 0.5 rounds |x| to a multiple of 2^-24 (the half subnormal step) and its low bits
    are the half's."""
    ax = b & np.uint32(0x7FFFFFFF)
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    m = ax - np.uint32(0x38000000)
    normal = (m + np.uint32(0xFFF) + ((m >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    sub = f32_to_bits(bits_to_f32(ax) + _HALF) - np.uint32(0x3F000000)
    return sign | (normal if ax >= np.uint32(0x38800000) else sub)


@njit(cache=True, inline="always", error_model="numpy")
def geglu_row(gate, up, table, out):
    """out = gelu(gate) * up as ggml_vec_geglu_f32 (GGML_GELU_FP16): 0 for x <= -10, x * up for
    x >= 10 (and NaN), table[f16(x)] * up between. gate, up, out: [n] f32; table: gelu_table().

    Two passes: LLVM emits no gathers for this CPU (it prefers scalar loads to vgatherdps), so
    a loop that reads the table stays scalar; the f16 rounding is the arithmetic, and it goes
    in its own loop, which vectorizes, ahead of the scalar table reads."""
    n = gate.shape[0]
    idx = np.empty(n, dtype=np.uint32)  # [n] f16 bit pattern of gate, 0 where |gate| >= 10
    for i in range(n):
        b = f32_to_bits(gate[i])
        idx[i] = f16_index(b) if (b & np.uint32(0x7FFFFFFF)) < _TEN_BITS else np.uint32(0)
    for i in range(n):
        x = gate[i]
        outside = np.float32(0.0) if x <= np.float32(-10.0) else x * up[i]
        inside = (f32_to_bits(x) & np.uint32(0x7FFFFFFF)) < _TEN_BITS
        out[i] = table[idx[i]] * up[i] if inside else outside
