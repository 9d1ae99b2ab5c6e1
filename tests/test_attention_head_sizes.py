"""Attention at head sizes that are not multiples of the kernels' 16 lanes, K and V apart (#24).

The kernels pad a head to the next multiple of 16 with zero components (kernels/attention.py,
"Head sizes"). Checked here at the sizes llama.cpp runs and the old kernels refused (8, 12, 24,
40, 72) and at 80 (a common size, no padding), with K != V, GQA ratios 1, 3 and 5, flash and
classic paths, f32 / f16 / bf16 caches (quantized caches need multiples of their block, refused
at context creation): against a float64 numpy reference, and every row bit-identical to the row
computed alone whatever shares the call, the thread count or the split.
"""

import numpy as np
import pytest

from kvchat.kernels.attention import attention
from kvchat.kernels.ggml_types import GGMLType
from tests.test_attention import _alone, _causal_mask, _make_rows, _reference, _threads_and_thresholds

N_KV = 300  # past one flash chunk (256), not a multiple of a tile (32)


def _case(type_k, type_v, dk, dv, n_tokens, n_head, n_head_kv, flash, seed):
    """Random Q, a K cache and a V cache (transposed for the classic path) of n_head_kv heads of
    dk / dv values, a causal mask with holes -> (q, k, v, mask, tok_stream, kval f64, vval f64)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
    kraw, kval = _make_rows(rng.standard_normal((N_KV, n_head_kv * dk)).astype(np.float32), type_k, rng)
    vx = rng.standard_normal((N_KV, n_head_kv * dv)).astype(np.float32)  # [cell, n_embd_v_gqa]
    if flash:
        vraw, vval = _make_rows(vx, type_v, rng)
        v = vraw.reshape(1, N_KV, -1)
    else:  # V^T [n_embd_v_gqa, kv_size]: the same values, stored per component
        vraw, vt_val = _make_rows(np.ascontiguousarray(vx.T), type_v, rng)
        v = vraw.reshape(1, n_head_kv * dv, -1)
        vval = vt_val.T
    mask = _causal_mask(n_tokens, N_KV, N_KV - n_tokens - 3, rng)
    ts = np.zeros(n_tokens, dtype=np.int32)
    kval = kval.reshape(1, N_KV, n_head_kv, dk)
    vval = vval.reshape(1, N_KV, n_head_kv, dv)
    return q, kraw.reshape(1, N_KV, -1), v, mask, ts, kval, vval


SHAPES = [  # (dk, dv, n_head, n_head_kv)
    (8, 8, 4, 4),
    (12, 12, 6, 2),
    (24, 24, 15, 3),
    (40, 40, 5, 1),
    (72, 72, 10, 2),
    (80, 80, 3, 3),
    (24, 40, 6, 2),
    (72, 8, 5, 1),
]


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
@pytest.mark.parametrize("cache", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"k{s[0]}v{s[1]}h{s[2]}kv{s[3]}" for s in SHAPES])
def test_odd_head_sizes_match_the_reference(shape, cache, flash):
    dk, dv, n_head, n_head_kv = shape
    q, k, v, mask, ts, kval, vval = _case(cache, cache, dk, dv, 7, n_head, n_head_kv, flash, seed=dk * 100 + dv)
    tk = tv = GGMLType[cache.upper()]
    got = attention(q, k, tk, v, tv, mask, ts, n_head_kv, 0.3, flash=flash)
    assert got.shape == (7, n_head * dv)
    p_type = None if flash or cache == "f32" else cache  # classic: P in V's dot type, as ggml
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.3, 0.0, p_type=p_type)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
@pytest.mark.parametrize("shape", [(12, 12, 6, 2), (24, 40, 5, 1), (72, 8, 6, 2)], ids=["k12", "k24v40", "k72v8"])
def test_odd_head_size_rows_are_bit_identical_to_the_row_alone(shape, flash, monkeypatch):
    """Every row of a 9-token call equals, bit for bit, the row computed alone (one token over
    the cells it sees, one thread) for 1 and 2 threads, at the parallel threshold and forced
    (which also splits the cells of few queries), for the last 1, 4 and 9 tokens."""
    dk, dv, n_head, n_head_kv = shape
    q, k, v, mask, ts, _, _ = _case("f16", "f16", dk, dv, 9, n_head, n_head_kv, flash, seed=7)
    tk = tv = GGMLType.F16
    alone = np.stack([_alone(q, k, tk, v, tv, mask, ts, n_head_kv, flash, i) for i in range(9)])
    for n_threads, _ in _threads_and_thresholds(monkeypatch):
        for n in (1, 4, 9):
            got = attention(
                q[-n:], k, tk, v, tv, mask[-n:], ts[-n:], n_head_kv, 0.125, flash=flash, n_threads=n_threads
            )
            np.testing.assert_array_equal(got, alone[-n:], err_msg=f"n={n} threads={n_threads}")


def test_internal_padding_is_explicit_zero_components_bit_for_bit():
    """A head of 72 (padded to 80 inside the kernels) gives the bits of the same head written out
    80 wide with its last 8 components zero in Q, K and V: the padding is exact zeros, nothing
    else, so the odd sizes run the very arithmetic of the common ones."""
    q, k, v, mask, ts, _, _ = _case("f32", "f32", 72, 72, 5, 4, 2, True, seed=3)
    got = attention(q, k, GGMLType.F32, v, GGMLType.F32, mask, ts, 2, 0.2)
    q80 = np.zeros((5, 4, 80), dtype=np.float32)
    q80[:, :, :72] = q
    k80 = np.zeros((1, N_KV, 2, 80), dtype=np.float32)
    k80[..., :72] = k.view(np.float32).reshape(1, N_KV, 2, 72)
    v80 = np.zeros((1, N_KV, 2, 80), dtype=np.float32)
    v80[..., :72] = v.view(np.float32).reshape(1, N_KV, 2, 72)
    k80, v80 = k80.reshape(1, N_KV, -1).view(np.uint8), v80.reshape(1, N_KV, -1).view(np.uint8)
    wide = attention(q80, k80, GGMLType.F32, v80, GGMLType.F32, mask, ts, 2, 0.2).reshape(5, 4, 80)
    np.testing.assert_array_equal(got.reshape(5, 4, 72), wide[:, :, :72])
