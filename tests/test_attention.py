"""Flash and classic attention kernels against a float64 numpy reference, for every cache type.

The cache rows are made with gguf-py's reference quantizer (random blocks for iq4_nl, which it
cannot quantize) and dequantized with gguf-py for the reference, so the kernels' in-place block
reading is checked independently of kernels/quants.py's own round trip.
"""
import gguf
import gguf.quants as gq
import numpy as np
import pytest

from kernels.attention import attention, round_q_like_ggml
from kernels.ggml_types import GGMLType

CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]


def _qt(name):
    return gguf.GGMLQuantizationType[name.upper()]


def _make_rows(x, name, rng):
    """x: [n_rows, n] f32 -> (u8 [n_rows, row_bytes] cache rows of format name, their f64 values)."""
    if name == "iq4_nl":  # random valid blocks: f16 scale + 16 bytes of nibbles per 32 values
        n_rows, n = x.shape
        blocks = np.zeros((n_rows, n // 32, 18), dtype=np.uint8)
        d = (rng.uniform(0.002, 0.02, (n_rows, n // 32))).astype(np.float16)
        blocks[:, :, :2] = d.view(np.uint8).reshape(n_rows, n // 32, 2)
        blocks[:, :, 2:] = rng.integers(0, 256, (n_rows, n // 32, 16), dtype=np.uint8)
        raw = blocks.reshape(n_rows, -1)
    else:
        raw = gq.quantize(x, _qt(name))  # f32/f16/bf16 come back as typed arrays
    vals = gq.dequantize(raw, _qt(name)).astype(np.float64)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(x.shape[0], -1), vals


def _reference(q, kvals, vvals, mask, tok_stream, n_head_kv, scale, softcap):
    """q [T,H,D]; kvals/vvals [S, n_kv, n_head_kv, D] f64; mask [T, n_kv] -> [T, H*Dv] f64."""
    T, H, D = q.shape
    g = H // n_head_kv
    out = np.zeros((T, H, vvals.shape[-1]))
    for t in range(T):
        s = tok_stream[t]
        for h in range(H):
            sc = kvals[s, :, h // g, :] @ q[t, h].astype(np.float64)
            sc = softcap * np.tanh(sc * scale / softcap) if softcap else sc * scale
            sc = sc + mask[t]
            if np.all(np.isinf(sc)):
                continue
            p = np.exp(sc - sc.max())
            out[t, h] = (p / p.sum()) @ vvals[s, :, h // g, :]
    return out.reshape(T, -1)


def _causal_mask(n_tokens, n_kv, past, rng, holes=True):
    """Token t sits at cell past + t and sees cells <= its own; a few random holes (other seqs)."""
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)
    for t in range(n_tokens):
        mask[t, : past + t + 1] = 0.0
    if holes:
        mask[:, rng.choice(past, size=max(1, past // 8), replace=False)] = -np.inf
    return mask


def _setup(type_k, type_v, n_tokens, n_head, n_head_kv, dk, n_kv, kv_size, n_stream, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
    kx = rng.standard_normal((n_stream * kv_size, n_head_kv * dk)).astype(np.float32)
    vx = rng.standard_normal((n_stream * kv_size, n_head_kv * dk)).astype(np.float32)
    kraw, kval = _make_rows(kx, type_k, rng)
    vraw, vval = _make_rows(vx, type_v, rng)
    kraw = kraw.reshape(n_stream, kv_size, -1)
    vraw = vraw.reshape(n_stream, kv_size, -1)
    kval = kval.reshape(n_stream, kv_size, n_head_kv, dk)[:, :n_kv]
    vval = vval.reshape(n_stream, kv_size, n_head_kv, dk)[:, :n_kv]
    past = n_kv - n_tokens - 3  # a few trailing cells stay masked (padding of n_kv)
    mask = _causal_mask(n_tokens, n_kv, past, rng)
    ts = (np.arange(n_tokens) % n_stream).astype(np.int32)
    return q, kraw, kval, vraw, vval, mask, ts


@pytest.mark.parametrize("type_k", CACHE_TYPES)
@pytest.mark.parametrize("shape", [(1, 9, 3), (5, 4, 1), (40, 9, 3)])
def test_flash_matches_reference_for_every_k_type(type_k, shape):
    n_tokens, n_head, n_head_kv = shape
    type_v = type_k
    q, kraw, kval, vraw, vval, mask, ts = _setup(type_k, type_v, n_tokens, n_head, n_head_kv, 64,
                                                 n_kv=103, kv_size=128, n_stream=1, seed=n_tokens)
    got = attention(q, kraw[:, :103], GGMLType[type_k.upper()], vraw[:, :103],
                    GGMLType[type_v.upper()], mask, ts, n_head_kv, 0.125, round_q=False)
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_v", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("type_k", ["f16", "q8_0", "q4_0"])
def test_classic_path_with_transposed_v(type_k, type_v):
    n_tokens, n_head, n_head_kv, dk, n_kv, kv_size = 37, 6, 2, 64, 96, 256
    q, kraw, kval, vraw, vval, mask, ts = _setup(type_k, type_v, n_tokens, n_head, n_head_kv, dk,
                                                 n_kv, kv_size, 1, seed=3)
    # transposed V cache: [n_stream, n_embd_v_gqa, kv_size * elem] bytes
    vt_vals = vval  # [1, n_kv, n_head_kv, dk]
    eb = 4 if type_v == "f32" else 2
    full = np.zeros((1, kv_size, n_head_kv * dk), dtype=np.float32)
    full[0, :n_kv] = vt_vals[0].reshape(n_kv, -1)
    vt_raw, _ = _make_rows(np.ascontiguousarray(full[0].T), type_v, None)
    vt_raw = vt_raw.reshape(1, n_head_kv * dk, kv_size * eb)
    got = attention(q, kraw[:, :n_kv], GGMLType[type_k.upper()], vt_raw, GGMLType[type_v.upper()],
                    mask, ts, n_head_kv, 0.125, flash=False, round_q=False)
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    flash = attention(q, kraw[:, :n_kv], GGMLType[type_k.upper()], vraw[:, :n_kv],
                      GGMLType[type_v.upper()], mask, ts, n_head_kv, 0.125, flash=True, round_q=False)
    np.testing.assert_allclose(got, flash, rtol=1e-4, atol=1e-4)


def test_mixed_k_v_types_softcap_and_two_streams():
    n_tokens, n_head, n_head_kv, dk, n_kv = 6, 4, 2, 64, 64
    q, kraw, kval, vraw, vval, mask, ts = _setup("q8_0", "q5_1", n_tokens, n_head, n_head_kv, dk,
                                                 n_kv, 64, n_stream=2, seed=5)
    got = attention(q * 4, kraw, GGMLType.Q8_0, vraw, GGMLType.Q5_1, mask, ts, n_head_kv, 0.125,
                    softcap=2.0, round_q=False)
    ref = _reference(q * 4, kval, vval, mask, ts, n_head_kv, 0.125, 2.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_fully_masked_query_gives_zeros():
    q, kraw, kval, vraw, vval, mask, ts = _setup("f16", "f16", 3, 2, 1, 64, 40, 64, 1, seed=7)
    mask[1, :] = -np.inf
    got = attention(q, kraw[:, :40], GGMLType.F16, vraw[:, :40], GGMLType.F16, mask, ts, 1, 0.125)
    assert np.all(got[1] == 0.0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("type_k", ["f16", "q8_0", "q4_0", "bf16"])
def test_q_rounding_follows_ggml_vec_dot_type(type_k):
    q = np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32)
    r = round_q_like_ggml(q, int(GGMLType[type_k.upper()]))
    if type_k == "f16":
        np.testing.assert_array_equal(r, q.astype(np.float16).astype(np.float32))
    else:
        rel = np.abs(r - q).max() / np.abs(q).max()
        assert 0 < rel < (1 / 127 if type_k != "bf16" else 1 / 128)


def test_fast_f16_row_is_exact_for_every_half():
    from kernels.attention import _f16_row_fast
    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, dtype=np.float32)
    _f16_row_fast(h.view(np.uint8), got)
    ref = h.view(np.float16).astype(np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all()
