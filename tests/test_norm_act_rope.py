"""RMSNorm, SwiGLU/GeGLU, softmax and RoPE against plain numpy (float64) references."""
import numpy as np
import pytest

from kernels.act import geglu, glu_fused, softmax, swiglu
from kernels.norm import rms_norm
from kernels.rope import rope_inplace


def _rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_numpy(with_weight):
    x = _rng().standard_normal((7, 576)).astype(np.float32) * 3
    w = _rng(1).standard_normal(576).astype(np.float32) if with_weight else None
    got = rms_norm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5)
    if with_weight:
        ref = ref * w
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


def test_rms_norm_per_head_and_in_place():
    x = _rng().standard_normal((3, 4, 64)).astype(np.float32)  # [n_tokens, n_head, head_dim]
    w = _rng(2).standard_normal(64).astype(np.float32)
    ref = x.astype(np.float64)
    ref = ref / np.sqrt((ref ** 2).mean(axis=-1, keepdims=True) + 1e-6) * w
    rms_norm(x, w, 1e-6, out=x)
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=2e-6)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))


def test_swiglu_and_geglu_match_numpy():
    g = (_rng().standard_normal((5, 1536)) * 4).astype(np.float32)
    u = _rng(1).standard_normal((5, 1536)).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    np.testing.assert_allclose(swiglu(g, u), g64 / (1 + np.exp(-g64)) * u64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(geglu(g, u), _gelu_tanh(g64) * u64, rtol=1e-5, atol=1e-6)
    fused = np.concatenate([g, u], axis=1)
    np.testing.assert_allclose(glu_fused(fused, 1536, True), geglu(g, u), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(glu_fused(fused, 1536, False), swiglu(g, u), rtol=1e-6, atol=1e-7)


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
