"""Rotary position embedding (RoPE), the two layouts llama.cpp knows.

"norm" (LLAMA_ROPE_TYPE_NORM) rotates adjacent pairs (x[2i], x[2i+1]); "neox" rotates
(x[i], x[i + n_rot/2]); dims from n_rot on pass through (partial rotary; n_rot 0 = no RoPE).
Used by the forward pass on fresh Q/K and by the KV cache's K-shift, which re-rotates cached
keys by a position delta (rotation by a then by b == rotation by a+b). As ggml_rope_ext:
optional per-pair frequency divisors (`freq_factors`, f32 [n_rot/2]: Llama-3 rope_freqs,
LongRoPE factors) and `attn_factor` multiplying cos and sin (LongRoPE's scaling).

The rotation is ggml's as its x86 build compiles it (GCC contracts rotate_pairs' x0*cos - x1*sin
into one fused step): x0' = fma(x0, cos, -(x1 sin)), x1' = fma(x0, sin, x1 cos), with cosf/sinf
of the f32 angle, so the values are llama.cpp's bits (tests/helpers/ggml_order.py). Compiled without
fast-math and with the fusion spelled out (kernels/ggml_math.fma32), so a token's result is the
same whether prepare_qkv runs its serial or its parallel twin (batch invariance,
kernels/attention.py). The cost is nil: a few hundred values per token next to cos/sin calls.
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.ggml_math import fma32
from kvchat.kernels.norm import rms_norm_row


@njit(cache=True, inline="always")
def _rope_cache(p, half, theta_scale, fs, ff, mscale, cs):
    """cs [half, 2] f32 <- (cos, sin) of position p. ggml's rope cache: theta_0 = p,
    theta_{i+1} = theta_i * base^(-2/n_rot), all in float32; pair i turns by
    freq_scale * theta_i / ff[i] and its cos and sin are multiplied by mscale (attn_factor).
    ff = ones and mscale = 1 give the plain rotation, bit for bit. YaRN (ggml's rope_yarn):
    ff holds n_rot values, the divisors then each pair's ramp mix r (yarn_factors), and the
    angle is interp * (1 - r) + extrap * r with interp = freq_scale * extrap (GCC's contraction:
    one fma) — mscale then carries YaRN's magnitude factor (yarn_mscale)."""
    theta = np.float32(p)
    yarn = half > 0 and ff.shape[0] >= 2 * half
    for i in range(half):
        te = np.float32(theta / ff[i])
        th = fs * te
        if yarn:
            r = ff[half + i]
            th = fma32(th, np.float32(1.0) - r, te * r)
        cs[i, 0] = np.float32(np.cos(th)) * mscale
        cs[i, 1] = np.float32(np.sin(th)) * mscale
        theta = np.float32(theta * theta_scale)


@njit(cache=True, inline="always")
def _rotate(xh, cs, half, neox):
    """Rotate one head xh [head_dim] f32 in place by the cached angles."""
    for i in range(half):
        c = cs[i, 0]
        s = cs[i, 1]
        if neox:
            a = xh[i]
            b = xh[i + half]
            xh[i] = fma32(a, c, -(b * s))
            xh[i + half] = fma32(a, s, b * c)
        else:
            a = xh[2 * i]
            b = xh[2 * i + 1]
            xh[2 * i] = fma32(a, c, -(b * s))
            xh[2 * i + 1] = fma32(a, s, b * c)


@njit(cache=True, parallel=True)
def _rope_inplace(x, pos, n_rot, theta_scale, fs, ff, mscale, neox):
    n_tokens, n_head, head_dim = x.shape
    half = n_rot // 2
    for t in prange(n_tokens):
        cs = np.empty((half, 2), dtype=np.float32)  # [half, (cos, sin)] f32
        _rope_cache(pos[t], half, theta_scale, fs, ff, mscale, cs)
        for h in range(n_head):
            _rotate(x[t, h], cs, half, neox)


@njit(cache=True, inline="always")
def _prep_token(
    t,
    q_in,
    k_in,
    v_in,
    q_norm,
    k_norm,
    has_norm,
    eps,
    pos,
    n_rot,
    theta_scale,
    fs,
    ff,
    mscale,
    neox,
    q_out,
    k_out,
    v_out,
    cs,
):
    n_head, dk = q_out.shape[1], q_out.shape[2]
    n_head_kv = k_out.shape[1]
    half = n_rot // 2
    _rope_cache(pos[t], half, theta_scale, fs, ff, mscale, cs)
    for h in range(n_head):
        for c in range(dk):
            q_out[t, h, c] = q_in[t, h * dk + c]
        if has_norm:
            rms_norm_row(q_out[t, h], q_norm, True, eps, q_out[t, h])
        _rotate(q_out[t, h], cs, half, neox)
    for h in range(n_head_kv):
        for c in range(dk):
            k_out[t, h, c] = k_in[t, h * dk + c]
        if has_norm:
            rms_norm_row(k_out[t, h], k_norm, True, eps, k_out[t, h])
        _rotate(k_out[t, h], cs, half, neox)
    for c in range(v_out.shape[1]):
        v_out[t, c] = v_in[t, c]


@njit(cache=True, parallel=True)
def _prep_qkv_par(
    q_in, k_in, v_in, q_norm, k_norm, has_norm, eps, pos, n_rot, theta_scale, fs, ff, mscale, neox, q_out, k_out, v_out
):
    for t in prange(q_out.shape[0]):
        cs = np.empty((n_rot // 2, 2), dtype=np.float32)
        _prep_token(
            t,
            q_in,
            k_in,
            v_in,
            q_norm,
            k_norm,
            has_norm,
            eps,
            pos,
            n_rot,
            theta_scale,
            fs,
            ff,
            mscale,
            neox,
            q_out,
            k_out,
            v_out,
            cs,
        )


@njit(cache=True)
def _prep_qkv_ser(
    q_in, k_in, v_in, q_norm, k_norm, has_norm, eps, pos, n_rot, theta_scale, fs, ff, mscale, neox, q_out, k_out, v_out
):
    cs = np.empty((n_rot // 2, 2), dtype=np.float32)
    for t in range(q_out.shape[0]):
        _prep_token(
            t,
            q_in,
            k_in,
            v_in,
            q_norm,
            k_norm,
            has_norm,
            eps,
            pos,
            n_rot,
            theta_scale,
            fs,
            ff,
            mscale,
            neox,
            q_out,
            k_out,
            v_out,
            cs,
        )


_ONE = np.ones(1, dtype=np.float32)


@njit(cache=True)
def _powf(a, b):
    """powf of two float32 values (libm's, as ggml calls it)."""
    return a**b


def _theta_scale(freq_base, n_rot) -> np.float32:
    """powf(base, -2.0f / n_rot) in float32, as ggml computes it (1 when nothing rotates)."""
    if not n_rot:
        return np.float32(1.0)
    return np.float32(_powf(np.float32(freq_base), np.float32(-2.0) / np.float32(n_rot)))


def _factors(freq_factors, n_rot) -> np.ndarray:
    """Per-pair divisors f32 [n_rot/2] (ones when the model has none)."""
    if freq_factors is None:
        return np.ones(max(n_rot // 2, 1), dtype=np.float32)
    ff = np.ascontiguousarray(freq_factors, dtype=np.float32)
    if ff.shape[0] < n_rot // 2:
        raise ValueError(f"rope: {ff.shape[0]} frequency factors for {n_rot // 2} rotated pairs")
    return ff


def yarn_factors(n_rot, freq_base, n_ctx_orig, freq_factors=None, beta_fast=32.0, beta_slow=1.0, ext_factor=1.0):
    """f32 [n_rot]: the per-pair divisors (ones without freq_factors) followed by YaRN's ramp mix of
    each pair, ggml's float32 arithmetic: corr dims floor/ceil(n_rot * logf(n_ctx_orig / (beta * 2 pi))
    / (2 logf(base))) clamped to [0, n_rot - 1], ramp 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1),
    times ext_factor (ggml_rope_yarn_corr_dims, rope_yarn_ramp)."""
    f = np.float32
    half = n_rot // 2

    def corr_dim(beta):
        num = f(n_rot) * f(np.log(f(f(n_ctx_orig) / (f(beta) * f(2) * f(np.pi)))))
        return num / (f(2) * f(np.log(f(freq_base))))

    lo = max(f(0), f(np.floor(corr_dim(beta_fast))))
    hi = min(f(n_rot - 1), f(np.ceil(corr_dim(beta_slow))))
    i = np.arange(half, dtype=np.float32)
    y = (i - lo) / max(f(0.001), f(hi - lo))
    ramp = (f(1) - np.minimum(f(1), np.maximum(f(0), y))).astype(np.float32) * f(ext_factor)
    ff = _factors(freq_factors, n_rot)[:half]
    return np.concatenate([ff, ramp.astype(np.float32)]).astype(np.float32)


def yarn_mscale(freq_scale, attn_factor=1.0) -> float:
    """The cos/sin multiplier of a YaRN layer: llama.cpp's yarn_attn_factor (get_mscale(1 / freq_scale) /
    (1 + 0.1 logf(1 / freq_scale)), times rope.scaling.attn_factor) times ggml's own 1 + 0.1 logf(1 /
    freq_scale), in float32 as the two compute them."""
    f = np.float32
    factor = f(1) / f(freq_scale)
    m = f(1) if factor <= 1 else f(f(0.1) * f(np.log(factor))) + f(1)
    m = f(m * f(f(1) / f(f(1) + f(f(0.1) * f(np.log(factor))))))
    m = f(m * f(attn_factor))
    return float(f(m * f(f(1) + f(f(0.1) * f(np.log(f(f(1) / f(freq_scale))))))))


def rope_inplace(x, pos, n_rot, freq_base, freq_scale, neox, freq_factors=None, attn_factor=1.0):
    """Rotate x in place. x: [n_tokens, n_head, head_dim] f32; pos: [n_tokens] i32 (or a delta)."""
    _rope_inplace(
        x,
        pos,
        int(n_rot),
        _theta_scale(freq_base, n_rot),
        np.float32(freq_scale),
        _factors(freq_factors, n_rot),
        np.float32(attn_factor),
        bool(neox),
    )


def rope_plan(n_rot, freq_base, freq_scale, freq_factors=None, attn_factor=1.0) -> tuple:
    """A layer's RoPE arguments as the kernels take them: (n_rot, theta_scale, freq_scale,
    factors f32 [n_rot/2], attn_factor). They are constants of the model and context, so the
    forward pass computes them once per layer (runtime/arch/blocks.py) instead of per call."""
    return (
        int(n_rot),
        _theta_scale(freq_base, n_rot),
        np.float32(freq_scale),
        _factors(freq_factors, n_rot),
        np.float32(attn_factor),
    )


def prepare_qkv(
    q_in,
    k_in,
    v_in,
    n_head,
    n_head_kv,
    head_dim,
    pos,
    n_rot,
    freq_base,
    freq_scale,
    neox,
    q_norm=None,
    k_norm=None,
    eps=1e-6,
    freq_factors=None,
    attn_factor=1.0,
):
    """Fresh Q/K/V of one layer in one launch: split (q_in/k_in/v_in may be column views of a
    fused QKV product, [n, width] f32), optional per-head RMSNorm of Q and K (QK-norm), RoPE
    of the first n_rot dims of each head (0 = none; freq_factors / attn_factor as ggml_rope_ext).

    Returns q [n, n_head, head_dim], k [n, n_head_kv, head_dim], v [n, v_width] (f32, contiguous).
    """
    return prepare_qkv_planned(
        q_in,
        k_in,
        v_in,
        n_head,
        n_head_kv,
        head_dim,
        pos,
        rope_plan(n_rot, freq_base, freq_scale, freq_factors, attn_factor),
        neox,
        q_norm,
        k_norm,
        eps,
    )


def prepare_qkv_planned(
    q_in, k_in, v_in, n_head, n_head_kv, head_dim, pos, plan, neox, q_norm=None, k_norm=None, eps=1e-6
):
    """prepare_qkv with the RoPE arguments of rope_plan (same kernel, same results); pos i32 [n]."""
    n = q_in.shape[0]
    q = np.empty((n, n_head, head_dim), dtype=np.float32)
    k = np.empty((n, n_head_kv, head_dim), dtype=np.float32)
    v = np.empty((n, v_in.shape[1]), dtype=np.float32)
    has_norm = q_norm is not None
    n_rot, theta_scale, fs, ff, mscale = plan
    fn = _prep_qkv_par if n >= parallel.ROPE_PAR_MIN_TOKENS else _prep_qkv_ser
    fn(  # C-contiguous inputs: one compiled layout (kernels/qkv_store.prepare_qkv_store says why)
        np.ascontiguousarray(q_in),
        np.ascontiguousarray(k_in),
        np.ascontiguousarray(v_in),
        q_norm if has_norm else _ONE,
        k_norm if has_norm else _ONE,
        has_norm,
        np.float64(eps),
        np.ascontiguousarray(pos, dtype=np.int32),
        n_rot,
        theta_scale,
        fs,
        ff,
        mscale,
        bool(neox),
        q,
        k,
        v,
    )
    return q, k, v
