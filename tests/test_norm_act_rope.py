"""RMSNorm, SwiGLU/GeGLU, softmax and RoPE against plain numpy (float64) references, and their
batch invariance: a row computed in a batch is bit-identical to the row computed alone."""

import numpy as np
import pytest
from numba import njit

from kvchat.kernels.act import geglu, glu_fused, softmax, swiglu
from kvchat.kernels.ggml_math import EXPF_AVX512, expf_ggml_avx2, expf_ggml_avx512, vexpf_ggml_avx2, vexpf_ggml_avx512
from kvchat.kernels.norm import rms_norm
from kvchat.kernels.rope import prepare_qkv, rope_inplace
from kvchat.kernels.simd import vload, vstore
from tests.helpers.ggml_order import (
    expf_reference_avx2,
    expf_reference_avx512,
    rms_norm_reference,
    rope_reference,
    silu_reference,
)


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_numpy(with_weight):
    x = _rng().standard_normal((7, 576)).astype(np.float32) * 3
    w = _rng(1).standard_normal(576).astype(np.float32) if with_weight else None
    got = rms_norm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5)
    if with_weight:
        ref = ref * w
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("width", [576, 64, 13])
def test_rms_norm_gives_ggmls_bits(width):
    """ggml's float order (tests/helpers/ggml_order.py), bit for bit, with and without the weight."""
    x = (_rng(5).standard_normal((40, width)) * _rng(6).uniform(0.01, 100, (40, 1))).astype(np.float32)
    w = _rng(7).standard_normal(width).astype(np.float32)
    np.testing.assert_array_equal(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    np.testing.assert_array_equal(rms_norm(x, None, 1e-6), rms_norm_reference(x, None, 1e-6))


def test_rms_norm_per_head_and_in_place():
    x = _rng().standard_normal((3, 4, 64)).astype(np.float32)  # [n_tokens, n_head, head_dim]
    w = _rng(2).standard_normal(64).astype(np.float32)
    ref = x.astype(np.float64)
    ref = ref / np.sqrt((ref**2).mean(axis=-1, keepdims=True) + 1e-6) * w
    rms_norm(x, w, 1e-6, out=x)
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=2e-6)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))


def test_swiglu_and_geglu_match_numpy():
    g = (_rng().standard_normal((5, 1536)) * 4).astype(np.float32)
    u = _rng(1).standard_normal((5, 1536)).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    np.testing.assert_allclose(swiglu(g, u), g64 / (1 + np.exp(-g64)) * u64, rtol=1e-5, atol=1e-6)
    # GELU is read from ggml's f16 table (tests/test_act_gelu.py): half precision
    np.testing.assert_allclose(geglu(g, u), _gelu_tanh(g64) * u64, rtol=2e-3, atol=2e-3)
    fused = np.concatenate([g, u], axis=1)
    np.testing.assert_allclose(glu_fused(fused, 1536, True), geglu(g, u), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(glu_fused(fused, 1536, False), swiglu(g, u), rtol=1e-6, atol=1e-7)


def test_swiglu_gives_ggmls_bits():
    """silu with ggml's own exp (tests/helpers/ggml_order.py), bit for bit, over the range where the
    exponential saturates too (|x| > 88)."""
    g = np.concatenate([np.linspace(-120, 120, 4001), _rng(9).standard_normal(3000) * 6]).astype(np.float32)
    g = np.concatenate([g, np.float32([0.0, -0.0, 1e-30, -1e-30])])
    u = _rng(10).standard_normal(g.size).astype(np.float32)
    want = (silu_reference(g) * u).astype(np.float32)
    np.testing.assert_array_equal(swiglu(g[None], u[None])[0], want)
    np.testing.assert_array_equal(glu_fused(np.concatenate([g, u])[None], g.size, False)[0], want)


def test_swiglu_gives_ggmls_bits_on_a_stride_of_all_float32_patterns():
    """The vectorized SiLU (2^n built from the exponent bits, kernels/ggml_math.scale_by_pow2)
    against the float64-scaled reference on every 4099th bit pattern (1M values: normals,
    subnormals) and densely where e^-x leaves the normal range
    (|x| 86..104: subnormal and overflowing results) and at the 192 saturation bound (|x| ~133).
    Odd widths run the vector loop's remainder too."""
    pats = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.concatenate([np.linspace(a, b, 20001) for a, b in ((86, 104), (-104, -86), (132, 134), (-134, -132))])
    g = np.concatenate([pats[np.isfinite(pats)], edges.astype(np.float32)])
    for width in (g.size, 13):
        x = g[:width]
        want = silu_reference(x)
        np.testing.assert_array_equal(swiglu(x[None], np.ones((1, width), np.float32))[0], want)
        np.testing.assert_array_equal(
            glu_fused(np.concatenate([x, np.ones(width, np.float32)])[None], width, False)[0], want
        )
    # the reference's emulated fma has no infinities; ggml: e^-inf = 0 (n <= 0), e^inf = inf
    np.testing.assert_array_equal(
        swiglu(np.float32([[np.inf, -np.inf]]), np.ones((1, 2), np.float32)), [[np.inf, np.nan]]
    )


@njit(cache=True)
def _expf_both(x, out2, out512):
    for i in range(x.size):
        out2[i] = expf_ggml_avx2(x[i])
        out512[i] = expf_ggml_avx512(x[i])


def test_both_forms_of_ggmls_exp_and_which_one_this_host_runs():
    """ggml_v_expf rounds differently in its AVX2 and AVX-512 forms (vec.h; #24: on an AVX2 host
    kvchat's SiLU, then the AVX-512 form, differed from llama.cpp's SWIGLU output in 12.4 % of
    5.9 M values of SmolLM2, and was equal in all of them with the AVX2 form). Each form against
    its numpy emulation, over normal inputs and the |n| > 126 and > 192 ranges (two-step
    scaling, 0 / inf); the two differ somewhere; swiglu uses this host's form."""
    x = np.concatenate(
        [np.linspace(-110, 110, 40001), _rng(3).standard_normal(20000) * 8, np.linspace(-140, -80, 6001)]
    ).astype(np.float32)
    x = np.concatenate([x, np.linspace(80, 95, 3001).astype(np.float32)])
    got2, got512 = np.empty_like(x), np.empty_like(x)
    _expf_both(x, got2, got512)
    np.testing.assert_array_equal(got2, expf_reference_avx2(x))
    np.testing.assert_array_equal(got512, expf_reference_avx512(x))
    assert np.any(got2 != got512)
    g = x[np.abs(x) < 80]
    e2, e512 = np.empty_like(g), np.empty_like(g)
    _expf_both((np.float32(0.0) - g).astype(np.float32), e2, e512)  # silu(x) = x / (1 + e^(0 - x))
    sil = (g / (np.float32(1.0) + (e512 if EXPF_AVX512 else e2))).astype(np.float32)
    np.testing.assert_array_equal(swiglu(g[None], np.ones((1, g.size), np.float32))[0], sil)


@njit(cache=True)
def _vexpf_both(x, out2, out512):
    for i in range(0, x.size, 16):
        vstore(out2, i, vexpf_ggml_avx2(vload(x, i)))
        vstore(out512, i, vexpf_ggml_avx512(vload(x, i)))


def test_vector_forms_of_ggmls_exp_are_the_scalar_ones_bit_for_bit():
    """kernels/ggml_math.vexpf_ggml_* (the ggml-order flash kernel's exp) equal the scalar forms in
    every lane, over the ranges of the test above, infinities and signed zeros."""
    x = np.concatenate(
        [np.linspace(-210, 210, 40001), _rng(4).standard_normal(20000) * 8, np.linspace(-140, -80, 6001)]
    ).astype(np.float32)
    x = np.concatenate([x, np.float32([np.inf, -np.inf, 0.0, -0.0, 88.72, 88.73, -1e30, 1e30])])
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
    s2, s512, v2, v512 = (np.empty_like(x) for _ in range(4))
    _expf_both(x, s2, s512)
    _vexpf_both(x, v2, v512)
    np.testing.assert_array_equal(v2.view(np.uint32), s2.view(np.uint32))
    np.testing.assert_array_equal(v512.view(np.uint32), s512.view(np.uint32))


def test_gelu_saturates_like_ggml():
    g = np.array([[-12.0, -10.0, 10.0, 11.0]], dtype=np.float32)
    u = np.ones_like(g)
    np.testing.assert_array_equal(geglu(g, u), [[0.0, 0.0, 10.0, 11.0]])


def test_softmax_with_masked_entries():
    x = _rng().standard_normal((4, 9)).astype(np.float32)
    x[1, :4] = -np.inf
    x[3, :] = -np.inf
    ref = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True).clip(-1e30))
    with np.errstate(invalid="ignore"):
        ref = np.nan_to_num(ref / ref.sum(axis=1, keepdims=True))
    got = softmax(x.copy())
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert np.all(got[3] == 0) and np.all(got[1, :4] == 0)


def _rope_ref(x, pos, n_rot, base, scale, neox):
    """float64 RoPE with the textbook theta_i = p * scale * base^(-2i/n_rot)."""
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    i = np.arange(half)
    theta = pos[:, None].astype(np.float64) * scale * base ** (-2.0 * i / n_rot)  # [n_tokens, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = out[..., :half].copy(), out[..., half:n_rot].copy()
        out[..., :half], out[..., half:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = out[..., 0:n_rot:2].copy(), out[..., 1:n_rot:2].copy()
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_matches_numpy(neox, n_rot):
    x = _rng().standard_normal((6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 300, 511], dtype=np.int32)
    ref = _rope_ref(x, pos, n_rot, 10000.0, 1.0, neox)
    rope_inplace(x, pos, n_rot, 10000.0, 1.0, neox)
    # ggml's float32 theta recurrence drifts ~1e-4 rad at p=511 from the float64 formula
    np.testing.assert_allclose(x, ref, rtol=0, atol=2e-3)
    assert np.abs(x[:3] - ref[:3]).max() < 1e-5


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot,base", [(64, 100000.0), (32, 10000.0)])
def test_rope_gives_ggmls_bits(neox, n_rot, base):
    """ggml's float order (tests/helpers/ggml_order.py), bit for bit, through rope_inplace and prepare_qkv."""
    x = (_rng(11).standard_normal((7, 3, 64)) * 4).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 300, 511, 4095], dtype=np.int32)
    want = rope_reference(x, pos, n_rot, base, neox)
    got = x.copy()
    rope_inplace(got, pos, n_rot, base, 1.0, neox)
    np.testing.assert_array_equal(got, want)
    flat = x.reshape(7, -1)
    q, k, _ = prepare_qkv(flat, flat, flat[:, :8], 3, 3, 64, pos, n_rot, base, 1.0, neox)
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(k, want)


def test_rope_composes_and_scales():
    x = _rng().standard_normal((4, 2, 64)).astype(np.float32)
    once = x.copy()
    rope_inplace(once, np.full(4, 12, np.int32), 64, 10000.0, 1.0, True)
    twice = x.copy()
    rope_inplace(twice, np.full(4, 5, np.int32), 64, 10000.0, 1.0, True)
    rope_inplace(twice, np.full(4, 7, np.int32), 64, 10000.0, 1.0, True)
    np.testing.assert_allclose(once, twice, atol=1e-5)
    half = x.copy()
    rope_inplace(half, np.full(4, 24, np.int32), 64, 10000.0, 0.5, False)
    ref = _rope_ref(x, np.full(4, 12, np.int32), 64, 10000.0, 1.0, False)
    np.testing.assert_allclose(half, ref, atol=1e-5)


# --- batch invariance: a row's result is the same bits whatever else the call holds ---

BATCH_SIZES = (1, 2, 7, 8, 16, 64, 300)


def _rows_invariant(fn, x, **kw):
    """fn(x[:n]) row by row equals fn(x[i:i+1]) for every n in BATCH_SIZES and 1 / 2 threads (the
    serial and the parallel twins of the kernels both run: their thresholds lie between)."""
    import numba

    n0 = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        alone = np.concatenate([fn(x[i : i + 1], **kw) for i in range(max(BATCH_SIZES))])
        for n_threads in (1, 2):
            numba.set_num_threads(n_threads)
            for n in BATCH_SIZES:
                np.testing.assert_array_equal(fn(x[:n], **kw), alone[:n], err_msg=f"n={n} threads={n_threads}")
    finally:
        numba.set_num_threads(n0)


@pytest.mark.parametrize("width", [576, 64, 13])
def test_rms_norm_rows_are_batch_invariant(width):
    """Model rows (576), QK-norm head rows (64), and a width that is no multiple of the 8 lanes."""
    x = (_rng(3).standard_normal((300, width)) * 5).astype(np.float32)
    w = _rng(4).standard_normal(width).astype(np.float32)
    _rows_invariant(lambda a: rms_norm(a, w, 1e-5), x)
    _rows_invariant(lambda a: rms_norm(a, None, 1e-6), x)


def test_activations_and_softmax_rows_are_batch_invariant():
    g = (_rng(5).standard_normal((300, 2 * 1536)) * 4).astype(np.float32)
    for use_gelu in (False, True):
        _rows_invariant(lambda a: glu_fused(a, 1536, use_gelu), g)
    _rows_invariant(lambda a: swiglu(a[:, :1536], a[:, 1536:]), g)
    _rows_invariant(lambda a: geglu(a[:, :1536], a[:, 1536:]), g)
    s = g[:, :40].copy()
    s[:, 30:] = -np.inf
    _rows_invariant(lambda a: softmax(a.copy()), s)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_and_prepare_qkv_rows_are_batch_invariant(neox):
    """prepare_qkv (split + QK-norm + RoPE) runs serially below 16 tokens and in parallel above;
    rope_inplace (the K-shift) is one parallel kernel. Positions up to 4095."""
    n, n_head, n_head_kv, hd = 300, 9, 3, 64
    pos = _rng(6).integers(0, 4096, n).astype(np.int32)
    fused = (_rng(7).standard_normal((n, (n_head + 2 * n_head_kv) * hd)) * 3).astype(np.float32)
    qn = _rng(8).standard_normal(hd).astype(np.float32)
    kn = _rng(9).standard_normal(hd).astype(np.float32)

    def prep(a, p, qk_norm):
        q, k, v = prepare_qkv(
            a[:, : n_head * hd],
            a[:, n_head * hd : (n_head + n_head_kv) * hd],
            a[:, (n_head + n_head_kv) * hd :],
            n_head,
            n_head_kv,
            hd,
            p,
            hd,
            10000.0,
            1.0,
            neox,
            q_norm=qn if qk_norm else None,
            k_norm=kn if qk_norm else None,
            eps=1e-6,
        )
        return np.concatenate([q.reshape(len(a), -1), k.reshape(len(a), -1), v], axis=1)

    both = np.concatenate([fused, pos[:, None].view(np.float32)], axis=1)  # carry each row's position
    for qk_norm in (False, True):
        _rows_invariant(lambda a: prep(a[:, :-1], np.ascontiguousarray(a[:, -1]).view(np.int32), qk_norm), both)

    def rope(a):
        x = a[:, :-1].copy().reshape(len(a), n_head, hd)  # rope works in place: never on the input
        rope_inplace(x, np.ascontiguousarray(a[:, -1]).view(np.int32), hd, 10000.0, 1.0, neox)
        return x.reshape(len(a), -1)

    _rows_invariant(rope, np.concatenate([fused[:, : n_head * hd], pos[:, None].view(np.float32)], axis=1))


def test_row_kernels_are_compiled_without_fast_math():
    """The numerics of these kernels are spelled out operation by operation: with fast-math LLVM
    may pick a summation order or an FMA per loop nest — and per compile (a helper inlined fresh
    or linked from numba's cache) — so identical source rounded differently in the serial and
    the parallel twin. Keep every kernel of these modules free of it."""
    from numba.core.registry import CPUDispatcher

    import kvchat.kernels.act
    import kvchat.kernels.attention
    import kvchat.kernels.attention_tiles
    import kvchat.kernels.norm
    import kvchat.kernels.rope

    found = 0
    for mod in (
        kvchat.kernels.act,
        kvchat.kernels.attention,
        kvchat.kernels.attention_tiles,
        kvchat.kernels.norm,
        kvchat.kernels.rope,
    ):
        for name, f in vars(mod).items():
            if isinstance(f, CPUDispatcher) and f.py_func.__module__ == mod.__name__:
                found += 1
                assert not f.targetoptions.get("fastmath"), f"{mod.__name__}.{name} uses fastmath"
    assert found > 30
