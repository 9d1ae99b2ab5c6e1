"""The mixture-of-experts block (runtime/arch/moe.py): routing (kernels/moe_route.py) against a
float64 re-statement of build_moe_ffn, mul_mat_id over stacked experts (kernels/matmul_id.py)
against float64 per-expert products, and batch invariance of both (array_equal)."""

import gguf
import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.matmul_id import ExpertMatrix
from kvchat.kernels.moe_route import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, route_experts


def _route64(logits, k, gating, norm, scale, bias=None):
    """build_moe_ffn's routing in float64 (stable top-k: ties in index order)."""
    x = logits.astype(np.float64)
    if gating == GATING_SOFTMAX:
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    elif gating == GATING_SIGMOID:
        p = 1 / (1 + np.exp(-x))
    else:
        p = x
    sel = p + (0 if bias is None else bias)
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    if gating == GATING_SOFTMAX_WEIGHT:
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    if norm:
        w /= w.sum(-1, keepdims=True)
    if scale not in (0.0, 1.0):
        w *= scale
    return ids, w


@pytest.mark.parametrize(
    "gating,norm,scale,biased",
    [
        (GATING_SOFTMAX, True, 0.0, False),
        (GATING_SOFTMAX, False, 2.5, False),
        (GATING_SIGMOID, True, 1.0, True),
        (GATING_SOFTMAX_WEIGHT, False, 0.0, False),
    ],
)
@pytest.mark.parametrize("n_expert,k", [(8, 2), (16, 4), (12, 3)])
def test_routing_matches_float64(gating, norm, scale, biased, n_expert, k):
    rng = np.random.default_rng(n_expert * 10 + k)
    logits = (2 * rng.standard_normal((37, n_expert))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(n_expert)).astype(np.float32) if biased else None
    ids, w = route_experts(logits, k, gating, norm, scale, bias)
    ids64, w64 = _route64(logits, k, gating, norm, scale, bias)
    np.testing.assert_array_equal(ids, ids64)
    np.testing.assert_allclose(w, w64, rtol=2e-6, atol=1e-7)
    for t in (0, 5, 36):  # a token routed alone gets the same bits
        i1, w1 = route_experts(logits[t : t + 1], k, gating, norm, scale, bias)
        np.testing.assert_array_equal(i1[0], ids[t])
        np.testing.assert_array_equal(w1[0], w[t])


def test_ties_keep_index_order_and_selection_bias_does_not_weight():
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0, 2.0]], np.float32)
    ids, _ = route_experts(logits, 4, GATING_SOFTMAX, False, 0.0)
    assert ids.tolist() == [[1, 2, 4, 6]]  # equal probabilities: lower expert first (std::sort's insertion sort)
    bias = np.zeros(8, np.float32)
    bias[0] = 10.0  # selected because of its bias, weighted by its unbiased probability
    ids, w = route_experts(logits, 2, GATING_SIGMOID, False, 0.0, bias)
    assert ids.tolist() == [[0, 1]]
    assert w[0, 0] == pytest.approx(1 / (1 + np.exp(-1.0)), rel=1e-6)


def _stack(n_expert, m, k, qt, seed):
    """A stacked expert tensor [n_expert, m, k] f32 and its file rows u8 [n_expert * m, row_bytes]."""
    x = (np.random.default_rng(seed).standard_normal((n_expert, m, k)) / np.sqrt(k)).astype(np.float32)
    q = x if qt == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(x, qt)
    raw = np.ascontiguousarray(q).view(np.uint8).reshape(n_expert * m, -1)
    deq = x if qt == gguf.GGMLQuantizationType.F32 else gguf.quants.dequantize(q, qt)
    return deq.astype(np.float64), raw


@pytest.mark.parametrize("qt", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0,
                                gguf.GGMLQuantizationType.Q4_0])  # fmt: skip
def test_matmul_id_matches_per_expert_products_and_is_batch_invariant(qt):
    n_expert, k_used, m, k, n = 8, 3, 48, 256, 21
    w64, raw = _stack(n_expert, m, k, qt, 3)
    w2, raw2 = _stack(n_expert, 40, k, qt, 4)
    em = ExpertMatrix([raw, raw2], int(qt), k, n_expert)  # gate | up stacked per expert
    assert (em.m, em.n_expert) == (88, n_expert)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.stack([rng.permutation(n_expert)[:k_used] for _ in range(n)]).astype(np.int32)
    y = em.matmul_id(x, ids)  # [n, k_used, 88]
    ref = np.concatenate([np.einsum("tk,tsmk->tsm", x.astype(np.float64), w64[ids]),
                          np.einsum("tk,tsmk->tsm", x.astype(np.float64), w2[ids])], axis=-1)  # fmt: skip
    tol = 1e-4 if qt == gguf.GGMLQuantizationType.F32 else 3e-2  # activations go through q8 blocks
    np.testing.assert_allclose(y, ref, atol=tol * np.abs(ref).max())
    for t in (0, 7, 20):
        np.testing.assert_array_equal(em.matmul_id(x[t : t + 1], ids[t : t + 1])[0], y[t])
    xs = rng.standard_normal((n, k_used, k)).astype(np.float32)  # a row per slot (the down projection)
    ys = em.matmul_id(xs, ids)
    for t in (1, 13):
        np.testing.assert_array_equal(em.matmul_id(xs[t : t + 1], ids[t : t + 1])[0], ys[t])
        for s in range(k_used):
            e = ids[t, s]
            own = QMatrix(np.concatenate([raw[e * m : (e + 1) * m], raw2[e * 40 : (e + 1) * 40]]), int(qt), k)
            np.testing.assert_array_equal(own.matmul(xs[t, s][None])[0], ys[t, s])


def test_matmul_id_refuses_an_expert_id_out_of_range():
    _, raw = _stack(4, 32, 32, gguf.GGMLQuantizationType.F32, 1)
    em = ExpertMatrix([raw], int(GGMLType.F32), 32, 4)
    with pytest.raises(IndexError, match="expert id"):
        em.matmul_id(np.zeros((1, 32), np.float32), np.array([[4]], np.int32))


def test_swiglu_oai_is_ggmls_f32_formula_with_libm_expf_on_strided_halves():
    """gpt-oss's activation, value by value as ggml_compute_forward_swiglu_oai_f32 computes it in
    f32 (expf correctly rounded = the float64 exp rounded once), on the gate and up halves of a
    fused [n, k, 2f] product (strided views, as moe_ffn passes them), specials included."""
    import math

    from kvchat.runtime.arch.moe import swiglu_oai

    f32 = np.float32
    rng = np.random.default_rng(5)
    n, k, f = 3, 4, 40
    gu = (rng.standard_normal((n, k, 2 * f)) * rng.choice([1e-3, 1.0, 4.0, 30.0], (n, k, 1))).astype(np.float32)
    gu.reshape(-1)[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 7.0, -7.0, 60.0]
    gu[0, 0, f : f + 4] = [np.nan, np.inf, -np.inf, -9.0]
    with np.errstate(all="ignore"):
        out = swiglu_oai(gu[:, :, :f], gu[:, :, f:])
    assert out.shape == (n, k, f) and out.dtype == np.float32

    def one(g, u):
        x = min(g, f32(7.0)) if not math.isnan(g) else g
        y = f32(min(max(u, f32(-7.0)), f32(7.0))) if not math.isnan(u) else u
        t = f32(f32(1.702) * f32(-x))
        try:
            e = f32(math.exp(float(t)))
        except OverflowError:
            e = f32(np.inf)
        return f32(f32(x / f32(f32(1.0) + e)) * f32(y + f32(1.0)))

    with np.errstate(all="ignore"):
        ref = np.array([one(g, u) for g, u in zip(gu[:, :, :f].reshape(-1), gu[:, :, f:].reshape(-1))], np.float32)
    assert np.array_equal(out.reshape(-1), ref, equal_nan=True)
