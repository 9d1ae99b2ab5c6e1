"""Activations quantized as ggml's CPU backend quantizes them before an integer dot product.

ggml converts the input row of every quantized matmul to the weight type's "vec_dot type":
q8_0 (q4_0, q5_0, q8_0, iq4_nl), q8_1 (q4_1, q5_1) or q8_K (the K-quants). The rounding here is
the one of ggml-cpu's x86 build, which is what llama.cpp runs on this machine:
- q8_0 / q8_1 (``quantize_row_q8_0`` / ``_q8_1``, AVX2 path), per 32 values: amax = max |x|,
  d = amax / 127, id = 127 / amax (0 when amax = 0), q = round-half-even(x * id); d is stored as
  f16 (we keep its f32 value), q8_1 adds s = f16(d * sum(q)) (d before its f16 rounding);
- q8_K (``quantize_row_q8_K_ref``), per 256 values: max = the first x of largest |x|,
  iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale (f32).
Also returned: the sum of every 16 consecutive q (q8_K's bsums; the kernel's offset terms).

Output per row t: ``xq`` i8 [n, k], ``xd`` f32 [n, k / 32 or k / 256] (the d each block's integer
dot is scaled by), ``xs`` i32 [n, k / 16], ``xm`` f32 [n, k / 32] (q8_1's s, else unused).
Every row is quantized alone, so the result of a row never depends on the batch.

NaN and infinities: integers cannot hold them, and a NaN would leave max |x| untouched and turn
into some integer, so a damaged weight (a NaN norm) would give finite, meaningless logits. Each
block's d gets + z, z the sum of x * 0 over the block: exactly 0 for finite values (d unchanged),
NaN otherwise, so the block's dot products come out NaN as in ggml (whose d or 1/d then is
NaN or infinite) and the sampler's check on the logits catches it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvchat.kernels.qlayout import ACT_Q8_1, ACT_Q8_K
from kvchat.kernels.quants_fp import f16_to_f32, f32_to_f16


@njit(cache=True, inline="always")
def _rint(v):
    """Round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) and ggml's nearest_int."""
    return np.int32(np.rint(v))


@njit(cache=True)
def quantize_row_q8(x, t, act, xq, xd, xs, xm):
    """Row t of x f32 [n, k] into row t of the outputs, in format act (ACT_Q8_0/1/K)."""
    k = x.shape[1]
    if act == ACT_Q8_K:
        for b in range(k // 256):
            o = b * 256
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            z = np.float32(0.0)  # 0, or NaN if the block holds a NaN or an infinity
            for j in range(256):
                ax = abs(x[t, o + j])
                z += x[t, o + j] * np.float32(0.0)
                if ax > amax:
                    amax = ax
                    mx = x[t, o + j]
            if amax == 0 or z != 0:  # a zero block (d 0), or a NaN / infinity in it (d NaN; no 1 / inf)
                xd[t, b] = z
                for j in range(256):
                    xq[t, o + j] = 0
                for j in range(16):
                    xs[t, o // 16 + j] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for g in range(16):
                s = np.int32(0)
                for j in range(16):
                    v = min(127, _rint(iscale * x[t, o + 16 * g + j]))
                    xq[t, o + 16 * g + j] = v
                    s += v
                xs[t, o // 16 + g] = s
            xd[t, b] = np.float32(1.0) / iscale + z
        return
    for b in range(k // 32):
        o = b * 32
        amax = np.float32(0.0)
        z = np.float32(0.0)  # 0, or NaN if the block holds a NaN or an infinity
        for j in range(32):
            amax = max(amax, abs(x[t, o + j]))
            z += x[t, o + j] * np.float32(0.0)
        d = amax / np.float32(127.0)
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        tot = np.int32(0)
        for g in range(2):
            s = np.int32(0)
            for j in range(16):
                v = _rint(x[t, o + 16 * g + j] * idd)
                xq[t, o + 16 * g + j] = v
                s += v
            xs[t, 2 * b + g] = s
            tot += s
        xd[t, b] = f16_to_f32(f32_to_f16(d)) + z
        if act == ACT_Q8_1:
            xm[t, b] = f16_to_f32(f32_to_f16(d * np.float32(tot)))
