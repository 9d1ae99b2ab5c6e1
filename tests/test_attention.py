"""Flash and classic attention kernels against a float64 numpy reference, for every cache type.

The cache rows are made with gguf-py's reference quantizer (random blocks for iq4_nl, which it
cannot quantize) and dequantized with gguf-py for the reference, so the kernels' in-place block
reading is checked independently of kernels/quants.py's own round trip.
"""

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from kvchat.kernels import parallel
from kvchat.kernels.attention import attention, round_q_to_vec_dot_type
from kvchat.kernels.ggml_types import GGMLType

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


def _reference(q, kvals, vvals, mask, tok_stream, n_head_kv, scale, softcap, sinks=None, p_type=None):
    """q [T,H,D]; kvals/vvals [S, n_kv, n_head_kv, D] f64; mask [T, n_kv] -> [T, H*Dv] f64; sinks [H]:
    one more logit per head in the softmax, with no value (gpt-oss). p_type "f16" / "bf16": the
    probabilities rounded to that type before P·V, as ggml's classic path (flash off) rounds them
    to an f16 / bf16 V's dot type."""
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
            m = sc.max() if sinks is None else max(sc.max(), float(sinks[h]))
            p = np.exp(sc - m)
            total = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            pr = (p / total).astype(np.float32)
            if p_type is not None:
                pr = gq.dequantize(gq.quantize(pr[None], _qt(p_type)), _qt(p_type))[0]
            out[t, h] = pr.astype(np.float64) @ vvals[s, :, h // g, :]
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
    q, kraw, kval, vraw, vval, mask, ts = _setup(
        type_k, type_v, n_tokens, n_head, n_head_kv, 64, n_kv=103, kv_size=128, n_stream=1, seed=n_tokens
    )
    got = attention(
        q,
        kraw[:, :103],
        GGMLType[type_k.upper()],
        vraw[:, :103],
        GGMLType[type_v.upper()],
        mask,
        ts,
        n_head_kv,
        0.125,
        round_q=False,
    )
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_v", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("type_k", ["f16", "q8_0", "q4_0"])
def test_classic_path_with_transposed_v(type_k, type_v):
    n_tokens, n_head, n_head_kv, dk, n_kv, kv_size = 37, 6, 2, 64, 96, 256
    q, kraw, kval, vraw, vval, mask, ts = _setup(
        type_k, type_v, n_tokens, n_head, n_head_kv, dk, n_kv, kv_size, 1, seed=3
    )
    # transposed V cache: [n_stream, n_embd_v_gqa, kv_size * elem] bytes
    vt_vals = vval  # [1, n_kv, n_head_kv, dk]
    eb = 4 if type_v == "f32" else 2
    full = np.zeros((1, kv_size, n_head_kv * dk), dtype=np.float32)
    full[0, :n_kv] = vt_vals[0].reshape(n_kv, -1)
    vt_raw, _ = _make_rows(np.ascontiguousarray(full[0].T), type_v, None)
    vt_raw = vt_raw.reshape(1, n_head_kv * dk, kv_size * eb)
    got = attention(
        q,
        kraw[:, :n_kv],
        GGMLType[type_k.upper()],
        vt_raw,
        GGMLType[type_v.upper()],
        mask,
        ts,
        n_head_kv,
        0.125,
        flash=False,
        round_q=False,
    )
    p_type = None if type_v == "f32" else type_v  # ggml's KQV: P in V's dot type
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0, p_type=p_type)
    # a p within an ulp of a rounding boundary may round the other way than the f64 reference's:
    # one step of p's type (f16 2^-11, bf16 2^-8 relative) times a value of V
    tol = {"f32": 1e-4, "f16": 3e-4, "bf16": 2e-3}[type_v]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=tol)
    flash = attention(
        q,
        kraw[:, :n_kv],
        GGMLType[type_k.upper()],
        vraw[:, :n_kv],
        GGMLType[type_v.upper()],
        mask,
        ts,
        n_head_kv,
        0.125,
        flash=True,
        round_q=False,
    )
    np.testing.assert_allclose(flash, _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dk", [64, 256, 24], ids=["d64", "d256", "d24"])
def test_classic_path_is_ggmls_flash_off_attention_bit_for_bit(dk, monkeypatch):
    """Flash off, f16 K and V, KVCHAT_GGML_ORDER=1: the classic kernel computes llama.cpp's
    non-flash graph exactly as ggml-cpu's AVX-512 build does
    (tests/helpers/ggml_order.classic_attention_reference: Q and the probabilities rounded to f16
    by mul_mat, ggml_v_expf, the softmax's 16-cell trees summed in double), every output bit for
    bit, whatever the batch around a row. Without the opt-in only the softmax sum's order differs."""
    import kvchat.kernels.attention as att
    from tests.helpers.ggml_order import classic_attention_reference

    monkeypatch.setattr(att, "GGML_SOFTMAX", True)

    n_tokens, n_head, n_head_kv, n_kv, kv_size = 21, 6, 2, 96, 128
    rng = np.random.default_rng(dk)
    q = (rng.standard_normal((n_tokens, n_head, dk)) * 2).astype(np.float32)
    kx = rng.standard_normal((kv_size, n_head_kv * dk)).astype(np.float32)
    vx = rng.standard_normal((kv_size, n_head_kv * dk)).astype(np.float32)
    kraw, kval = _make_rows(kx, "f16", rng)
    vt_raw, _ = _make_rows(np.ascontiguousarray(vx.T), "f16", rng)  # V^T [n_embd_v_gqa, kv_size]
    mask = _causal_mask(n_tokens, n_kv, n_kv - n_tokens - 5, rng)
    ts = np.zeros(n_tokens, np.int32)
    args = (kraw.reshape(1, kv_size, -1)[:, :n_kv], GGMLType.F16, vt_raw.reshape(1, n_head_kv * dk, -1), GGMLType.F16)
    got = attention(q, *args, mask, ts, n_head_kv, 0.125, flash=False, round_q=True)
    k = kval.reshape(kv_size, n_head_kv, dk)[:n_kv].astype(np.float32)
    v = vx.astype(np.float16).astype(np.float32).reshape(kv_size, n_head_kv, dk)[:n_kv]
    want = classic_attention_reference(q, k, v, mask, 0.125)
    np.testing.assert_array_equal(got, want)
    for t in (0, 7, n_tokens - 1):  # a row alone: the same bits
        alone = attention(q[t : t + 1], *args, mask[t : t + 1], ts[:1], n_head_kv, 0.125, flash=False, round_q=True)
        np.testing.assert_array_equal(alone[0], want[t])
    monkeypatch.setattr(att, "GGML_SOFTMAX", False)  # the default exp and sum: a p that rounds to
    default = attention(q, *args, mask, ts, n_head_kv, 0.125, flash=False, round_q=True)  # another f16
    np.testing.assert_allclose(default, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dk", [64, 24], ids=["d64", "d24"])
def test_ggml_order_flash_is_ggmls_tiled_flash_bit_for_bit(dk, monkeypatch):
    """KVCHAT_GGML_ORDER=1, flash on, f16 K and V: kernels/attention_ggml.py computes ggml's tiled
    flash attention (the prefill path of llama.cpp's CPU flash attention) bit for bit
    (tests/helpers/ggml_order.flash_tiled_reference), each row the same alone, serial or parallel."""
    import kvchat.kernels.attention as att
    from tests.helpers.ggml_order import flash_tiled_reference

    monkeypatch.setattr(att, "GGML_FLASH", True)
    n_tokens, n_head, n_head_kv, n_kv = 70, 6, 2, 150
    rng = np.random.default_rng(dk + 1)
    q = (rng.standard_normal((n_tokens, n_head, dk)) * 2).astype(np.float32)
    kx = rng.standard_normal((n_kv, n_head_kv * dk)).astype(np.float32)
    vx = rng.standard_normal((n_kv, n_head_kv * dk)).astype(np.float32)
    kraw, kval = _make_rows(kx, "f16", rng)
    vraw, vval = _make_rows(vx, "f16", rng)
    mask = _causal_mask(n_tokens, n_kv, n_kv - n_tokens - 5, rng)
    ts = np.zeros(n_tokens, np.int32)
    args = (kraw.reshape(1, n_kv, -1), GGMLType.F16, vraw.reshape(1, n_kv, -1), GGMLType.F16)
    got = attention(q, *args, mask, ts, n_head_kv, 0.125, flash=True)
    k = kval.reshape(n_kv, n_head_kv, dk).astype(np.float32)
    v = vval.reshape(n_kv, n_head_kv, dk).astype(np.float32)
    np.testing.assert_array_equal(got, flash_tiled_reference(q, k, v, mask, 0.125))
    for t in (0, 33, n_tokens - 1):
        alone = attention(q[t : t + 1], *args, mask[t : t + 1], ts[:1], n_head_kv, 0.125, flash=True, n_threads=1)
        np.testing.assert_array_equal(alone[0], got[t])


def test_ggml_order_flash_two_streams_rows_are_their_streams(monkeypatch):
    """KVCHAT_GGML_ORDER=1 flash with two streams in one call: each row is its stream's tiled
    flash attention (the reference over that stream's cells), and the row computed alone."""
    import kvchat.kernels.attention as att
    from tests.helpers.ggml_order import flash_tiled_reference

    monkeypatch.setattr(att, "GGML_FLASH", True)
    n_tokens, n_head, n_head_kv, dk, n_kv = 9, 4, 2, 64, 80
    q, kraw, kval, vraw, vval, mask, ts = _setup("f16", "f16", n_tokens, n_head, n_head_kv, dk, n_kv, 96, 2, seed=9)
    args = (kraw[:, :n_kv], GGMLType.F16, vraw[:, :n_kv], GGMLType.F16)
    got = attention(q, *args, mask, ts, n_head_kv, 0.125, flash=True)
    for t in range(n_tokens):
        s = ts[t]
        want = flash_tiled_reference(
            q[t : t + 1], kval[s].astype(np.float32), vval[s].astype(np.float32), mask[t : t + 1], 0.125
        )
        np.testing.assert_array_equal(got[t], want[0])


def test_ggml_order_flash_splits_a_kv_heads_query_heads_over_units_without_changing_a_bit():
    """One kv head (Gemma-3), one token: ggml_flash_units splits the query heads over the threads
    (heads per unit 2, then 1); every unit layout gives the same rows, the tiled reference's."""
    from kvchat.kernels.attention_ggml import ggml_flash_par, ggml_flash_ser, ggml_flash_units
    from tests.helpers.ggml_order import flash_tiled_reference

    assert ggml_flash_units(1, 4, 1, 2) == (1, 2, 2)
    assert ggml_flash_units(1, 4, 1, 4) == (1, 1, 4)
    assert ggml_flash_units(1, 9, 3, 2) == (1, 3, 3)  # enough kv heads: no split
    n_tokens, n_head, n_head_kv, dk, n_kv = 3, 4, 1, 64, 200
    q, kraw, kval, vraw, vval, mask, ts = _setup("f16", "f16", n_tokens, n_head, n_head_kv, dk, n_kv, 200, 1, seed=21)
    start = np.zeros(n_tokens, np.int64)
    want = flash_tiled_reference(q, kval[0].astype(np.float32), vval[0].astype(np.float32), mask, 0.125).reshape(
        n_tokens, n_head, dk
    )
    for hpu in (4, 2, 1):
        for fn in (ggml_flash_ser, ggml_flash_par):
            out = np.full((n_tokens, n_head, dk), np.nan, np.float32)
            n_units = n_tokens * (n_head // hpu)
            fn(q, kraw, int(GGMLType.F16), vraw, int(GGMLType.F16), mask, start, ts, n_head_kv,
               np.float32(0.125), np.float32(0.0), 1, hpu, n_units, out)  # fmt: skip
            np.testing.assert_array_equal(out, want, err_msg=f"hpu {hpu}")


def test_mixed_k_v_types_softcap_and_two_streams():
    n_tokens, n_head, n_head_kv, dk, n_kv = 6, 4, 2, 64, 64
    q, kraw, kval, vraw, vval, mask, ts = _setup(
        "q8_0", "q5_1", n_tokens, n_head, n_head_kv, dk, n_kv, 64, n_stream=2, seed=5
    )
    got = attention(
        q * 4, kraw, GGMLType.Q8_0, vraw, GGMLType.Q5_1, mask, ts, n_head_kv, 0.125, softcap=2.0, round_q=False
    )
    ref = _reference(q * 4, kval, vval, mask, ts, n_head_kv, 0.125, 2.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
def test_attention_sinks_join_each_heads_softmax(flash):
    """gpt-oss's sinks: one learned logit per head in the softmax (ggml_soft_max_ext / flash_attn_ext
    sinks), above and below the scores' max; a query that sees no cell still gives zeros."""
    n_tokens, n_head, n_head_kv, dk, n_kv = 9, 4, 2, 64, 70
    q, kraw, kval, vraw, vval, mask, ts = _setup("f32", "f32", n_tokens, n_head, n_head_kv, dk, n_kv, 128, 1, seed=41)
    mask[4, :] = -np.inf
    sinks = np.array([-1.5, 0.3, 4.0, 40.0], np.float32)  # the last one dominates every score
    v = vraw[:, :n_kv]
    if not flash:
        full = np.zeros((128, n_head_kv * dk), dtype=np.float32)
        full[:n_kv] = vval[0].reshape(n_kv, -1)
        v = _make_rows(np.ascontiguousarray(full.T), "f32", None)[0].reshape(1, n_head_kv * dk, 128 * 4)
    got = attention(
        q, kraw[:, :n_kv], GGMLType.F32, v, GGMLType.F32, mask, ts, n_head_kv, 0.125, flash=flash, sinks=sinks
    )
    ref = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0, sinks)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    plain = _reference(q, kval, vval, mask, ts, n_head_kv, 0.125, 0.0)
    assert np.abs(ref - plain).max() > 0.1  # the sinks change the result
    assert np.all(got[4] == 0.0)


def test_sinks_split_flash_walk_gives_the_unsplit_bits():
    """A long decode's chunks spread over units fold the sink in as the unsplit walk does."""
    q, kraw, kval, vraw, vval, mask, ts = _setup("q8_0", "q8_0", 2, 6, 2, 64, 699, 768, 1, seed=43)
    sinks = np.array([0.5, -2.0, 3.0, 1.0, 8.0, -0.25], np.float32)
    args = (q, kraw[:, :699], GGMLType.Q8_0, vraw[:, :699], GGMLType.Q8_0, mask, ts, 2, 0.125)
    walk = _flash_run(*args, split=False, parallel=False, sinks=sinks)
    for cpu in (1, 2):
        np.testing.assert_array_equal(_flash_run(*args, split=True, cpu=cpu, sinks=sinks), walk)
    ref = _reference(q, kval, vval, mask, ts, 2, 0.125, 0.0, sinks)
    np.testing.assert_allclose(walk, ref, rtol=1e-3, atol=1e-3)


def test_fully_masked_query_gives_zeros():
    q, kraw, kval, vraw, vval, mask, ts = _setup("f16", "f16", 3, 2, 1, 64, 40, 64, 1, seed=7)
    mask[1, :] = -np.inf
    got = attention(q, kraw[:, :40], GGMLType.F16, vraw[:, :40], GGMLType.F16, mask, ts, 1, 0.125)
    assert np.all(got[1] == 0.0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("type_k", ["f16", "q8_0", "q4_0", "bf16"])
def test_q_rounding_follows_ggml_vec_dot_type(type_k):
    q = np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32)
    r = round_q_to_vec_dot_type(q, int(GGMLType[type_k.upper()]))
    if type_k == "f16":
        np.testing.assert_array_equal(r, q.astype(np.float16).astype(np.float32))
    else:
        rel = np.abs(r - q).max() / np.abs(q).max()
        assert 0 < rel < (1 / 127 if type_k != "bf16" else 1 / 128)


def test_fast_f16_row_is_exact_for_every_half():
    from kvchat.kernels.attention_tiles import _f16_row_fast

    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, dtype=np.float32)
    _f16_row_fast(h.view(np.uint8), got)
    ref = h.view(np.float16).astype(np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all()


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("n_tokens", [1, 40])  # one token: the split walk; 40: token blocks
def test_an_f16_cache_gives_the_same_bits_with_its_type_fixed_at_compile_time(flash, n_tokens, monkeypatch):
    """kernel_cache_types hands an f16/f16 cache to the kernels as compile-time constants (only
    f16's tile code compiled); the generic kernel, with the types as run-time ints, runs the
    same decode: the outputs are bit-identical, on one thread and on two."""
    import kvchat.kernels.attention as attn

    q, kraw, _, vraw, _, mask, ts = _setup("f16", "f16", n_tokens, 8, 2, 64, n_kv=700, kv_size=768, n_stream=1, seed=5)
    v = vraw[:, :700] if flash else _transposed_v("f16", 700, 2 * 64, 768, np.random.default_rng(6))
    outs = []
    for as_ints in (False, True):
        if as_ints:
            monkeypatch.setattr(attn, "kernel_cache_types", lambda tk, tv: (int(tk), int(tv)))
        for threads in (1, 2):
            monkeypatch.setattr(parallel, "ATTN_PAR_MIN_MACS", 1)
            outs.append(attention(q, kraw[:, :700], GGMLType.F16, v, GGMLType.F16, mask, ts, 2, 0.125, flash=flash,
                                  n_threads=threads, round_q=False))  # fmt: skip
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


# --- flash-decoding: chunks of cells spread over threads, partial softmaxes folded in order ---


def _flash_run(q, k, tk, v, tv, mask, ts, n_head_kv, scale, split, parallel=True, softcap=0.0, cpu=1, sinks=None):
    """Run the flash kernel with groups of cpu chunks as units (split) or each unit walking all chunks."""
    from kvchat.kernels.attention import NO_SINKS, _values_per_bytes
    from kvchat.kernels.attention_flash import _NO_PARTIALS, _flash_attn_par, _partials, flash_attn_ser

    n_tokens, n_head = q.shape[:2]
    dv = _values_per_bytes(int(tv), v.shape[2] // n_head_kv)
    out = np.empty((n_tokens, n_head, dv), dtype=np.float32)
    tb = 1 if k.shape[0] > 1 else min(32, n_tokens)
    pm, ps, pacc, bm, bs, bacc = _partials(mask.shape[1], n_tokens, n_head, dv) if split else _NO_PARTIALS
    n_units = n_head_kv * -(-n_tokens // tb) * (-(-pm.shape[0] // cpu) if split else 1)
    fn = _flash_attn_par if parallel else flash_attn_ser
    start = np.zeros(n_tokens, dtype=np.int64)
    fn(
        np.ascontiguousarray(q),
        k,
        int(tk),
        v,
        int(tv),
        np.ascontiguousarray(mask),
        start,
        ts.astype(np.int32),
        int(n_head_kv),
        np.float32(scale),
        np.float32(softcap),
        NO_SINKS if sinks is None else np.asarray(sinks, np.float32),
        tb,
        split,
        cpu,
        n_units,
        pm,
        ps,
        pacc,
        bm,
        bs,
        bacc,
        out,
    )
    return out.reshape(n_tokens, -1)


@pytest.mark.parametrize("type_k", CACHE_TYPES)
def test_split_matches_reference_and_the_unsplit_walk_bit_for_bit(type_k):
    """n_kv = 699: three chunks of 256, the last one partial and ending inside a tile; one chunk
    per unit, two per unit, or all of them in one serial walk give the same bits."""
    n_kv = 699
    q, kraw, kval, vraw, vval, mask, ts = _setup(type_k, type_k, 2, 9, 3, 64, n_kv, 768, 1, seed=11)
    tk = GGMLType[type_k.upper()]
    got = _flash_run(q, kraw[:, :n_kv], tk, vraw[:, :n_kv], tk, mask, ts, 3, 0.125, split=True)
    ref = _reference(q, kval, vval, mask, ts, 3, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    one = _flash_run(q, kraw[:, :n_kv], tk, vraw[:, :n_kv], tk, mask, ts, 3, 0.125, split=False, parallel=False)
    np.testing.assert_array_equal(got, one)
    two = _flash_run(q, kraw[:, :n_kv], tk, vraw[:, :n_kv], tk, mask, ts, 3, 0.125, split=True, cpu=2)
    np.testing.assert_array_equal(two, one)  # groups of two chunks (the last one alone)


def test_split_with_fully_masked_chunks_and_a_single_visible_cell():
    """Chunks that the mask hides entirely contribute nothing; a query that sees one cell returns
    exactly that cell's V row (per head), wherever the cell lies among the chunks."""
    n_kv = 1000
    q, kraw, kval, vraw, vval, mask, ts = _setup("f16", "f16", 3, 4, 2, 64, n_kv, 1024, 1, seed=13)
    mask[:] = -np.inf
    mask[0, 650:790] = 0.0  # a sliding window: chunks 0 and 1 fully masked for token 0
    mask[1, 77] = 0.0  # token 1 sees a single cell in the middle of a tile of chunk 0
    mask[2, :] = -np.inf  # token 2 sees nothing -> zeros
    got = _flash_run(q, kraw[:, :n_kv], GGMLType.F16, vraw[:, :n_kv], GGMLType.F16, mask, ts, 2, 0.125, True)
    ref = _reference(q, kval, vval, mask, ts, 2, 0.125, 0.0)
    np.testing.assert_allclose(got[:2], ref[:2], rtol=1e-5, atol=1e-5)
    one_cell = vval[0, 77].reshape(-1).astype(np.float32)  # [n_head_kv * dv]: heads 0,1 -> kv 0; 2,3 -> kv 1
    np.testing.assert_array_equal(got[1].reshape(4, 64), one_cell.reshape(2, 64)[[0, 0, 1, 1]])
    assert np.all(got[2] == 0.0)


def test_split_two_streams_and_softcap():
    q, kraw, kval, vraw, vval, mask, ts = _setup("q8_0", "q4_1", 4, 4, 2, 64, 600, 600, n_stream=2, seed=17)
    got = _flash_run(q * 4, kraw, GGMLType.Q8_0, vraw, GGMLType.Q4_1, mask, ts, 2, 0.125, True, softcap=2.0)
    ref = _reference(q * 4, kval, vval, mask, ts, 2, 0.125, 2.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    one = _flash_run(q * 4, kraw, GGMLType.Q8_0, vraw, GGMLType.Q4_1, mask, ts, 2, 0.125, False, softcap=2.0)
    np.testing.assert_array_equal(got, one)


@pytest.mark.parametrize(
    "n_tokens,n_kv,n_threads,split",
    [
        (1, 4352, 2, True),
        (1, 4352, 4, True),
        (7, 1000, 2, True),
        (1, 256, 2, False),
        (512, 4608, 2, False),
        (3, 4100, 1, False),
        (300, 700, 2, False),
    ],
)
def test_flash_plan_splits_only_decode_sized_calls(n_tokens, n_kv, n_threads, split):
    """Few queries and several chunks: groups of chunks become the units, about four per thread,
    every chunk in exactly one group; otherwise (prompts, one thread, a single chunk) every unit
    walks all chunks."""
    from kvchat.kernels.attention_flash import CHUNK, flash_plan

    tb, got_split, cpu = flash_plan(n_tokens, 3, n_kv, 1, n_threads)
    n_ch = -(-n_kv // CHUNK)
    assert (tb, got_split) == (min(32, n_tokens), split)
    if split:
        n_units = 3 * -(-n_tokens // tb) * -(-n_ch // cpu)
        assert cpu == 1 or n_units >= 2 * n_threads
    else:
        assert cpu == n_ch


def test_attention_splits_long_decode_and_matches_reference():
    """Through the public entry: one token over 1200 cells with 2 threads takes the split path."""
    from kvchat.kernels.attention_flash import flash_plan

    assert flash_plan(1, 3, 1200, 1, 2)[1]
    q, kraw, kval, vraw, vval, mask, ts = _setup("q8_0", "q8_0", 1, 9, 3, 64, 1200, 1280, 1, seed=19)
    got = attention(q, kraw[:, :1200], GGMLType.Q8_0, vraw[:, :1200], GGMLType.Q8_0, mask, ts, 3, 0.125, n_threads=2)
    ref = _reference(q, kval, vval, mask, ts, 3, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_fast_exp_matches_numpy_and_maps_minus_inf_to_zero():
    from numba import njit

    from kvchat.kernels.attention_tiles import exp_le0

    @njit
    def run(x, y):
        for i in range(x.shape[0]):
            y[i] = exp_le0(x[i])

    x = np.concatenate([-np.logspace(-8, np.log10(86.9), 20001), [0.0, -0.0]]).astype(np.float32)
    y = np.empty_like(x)
    run(x, y)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / ref) < 3e-7
    z = np.array([-np.inf, -87.0, -88.0, -1e30], dtype=np.float32)  # below e^-87 (~1.6e-38): flushed
    run(z, y[:4])
    assert np.all(y[:4] == 0.0)


# --- batch invariance: a query's row is the same bits whatever else the call holds ---

BATCH_SIZES = (1, 2, 7, 8, 16, 64, 300)
N_KV = 700  # neither a multiple of the chunk (256) nor of the tile (32)


def _swa_mask(n_tokens, n_kv, past, n_swa):
    """Token t at cell past + t sees the n_swa cells up to and including its own."""
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)
    for t in range(n_tokens):
        mask[t, max(0, past + t + 1 - n_swa) : past + t + 1] = 0.0
    return mask


def _transposed_v(type_v, n_kv, n_cols, kv_size, rng):
    """A transposed V cache u8 [1, n_cols, kv_size * elem] of random values (classic path)."""
    x = rng.standard_normal((n_cols, kv_size)).astype(np.float32)
    raw, _ = _make_rows(x, type_v, rng)
    return raw.reshape(1, n_cols, -1)


def _alone(q, k, tk, v, tv, mask, ts, n_head_kv, flash, i):
    """Row i computed by itself, over only the cells up to its last visible one (a smaller n_kv,
    as a one-token decode at that point would see), one thread."""
    n = int(np.flatnonzero(mask[i] == 0.0).max()) + 1
    vv = v[:, :n] if flash else v
    return attention(
        q[i : i + 1],
        k[:, :n],
        tk,
        vv,
        tv,
        mask[i : i + 1, :n],
        ts[i : i + 1],
        n_head_kv,
        0.125,
        flash=flash,
        n_threads=1,
    )[0]


def _threads_and_thresholds(monkeypatch):
    """Yield (n_threads, min_work) for 1 and 2 numba threads x the parallel threshold at its real
    value and forced to 0 (which also forces the flash path to split the cells of few queries);
    the thread count and the threshold are restored afterwards."""
    import numba

    n_threads0 = numba.get_num_threads()
    try:
        for n_threads in (1, 2):
            numba.set_num_threads(n_threads)
            for min_work in (parallel.ATTN_PAR_MIN_MACS, 0):
                monkeypatch.setattr(parallel, "ATTN_PAR_MIN_MACS", min_work)
                yield n_threads, min_work
                monkeypatch.undo()
    finally:
        numba.set_num_threads(n_threads0)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
@pytest.mark.parametrize("type_k", CACHE_TYPES)
def test_each_row_is_bit_identical_to_the_row_computed_alone(type_k, flash, monkeypatch):
    """For n in BATCH_SIZES (the last n tokens, which see the most cells), 1 and 2 threads, and the
    parallel launch both at its real threshold and forced (which also forces the split of the
    cells for few queries): every output row equals, bit for bit, the row computed alone.
    GQA (9 heads over 3), causal mask with holes, n_kv not a multiple of chunks or tiles."""
    type_v = type_k if flash else {"f32": "f32", "bf16": "bf16"}.get(type_k, "f16")
    n_max = max(BATCH_SIZES)
    q, k, _, v, _, mask, ts = _setup(type_k, type_v, n_max, 9, 3, 64, N_KV, 768, 1, seed=23)
    if not flash:
        v = _transposed_v(type_v, N_KV, 3 * 64, 768, np.random.default_rng(5))
    tk, tv = GGMLType[type_k.upper()], GGMLType[type_v.upper()]
    alone = np.stack([_alone(q, k, tk, v, tv, mask, ts, 3, flash, i) for i in range(n_max)])
    for n_threads, _ in _threads_and_thresholds(monkeypatch):
        for n in BATCH_SIZES:
            got = attention(q[-n:], k, tk, v, tv, mask[-n:], ts[-n:], 3, 0.125, flash=flash, n_threads=n_threads)
            np.testing.assert_array_equal(got, alone[-n:], err_msg=f"n={n} threads={n_threads}")


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
def test_sliding_window_rows_and_other_companions_are_invariant(flash, monkeypatch):
    """SWA mask (window 100): a token's row does not depend on which tokens share the call (here
    every other token, in reverse order) nor on the split; and a decode with a single cell
    visible in the last, partial tile matches as well. GQA 8 heads over 2."""
    import numba

    n_max, n_kv = 64, 433
    q, k, _, v, _, _, ts = _setup("f16", "f16", n_max, 8, 2, 64, n_kv, 512, 1, seed=29)
    if not flash:
        v = _transposed_v("f16", n_kv, 2 * 64, 512, np.random.default_rng(6))
    mask = _swa_mask(n_max, n_kv, n_kv - n_max, 100)
    alone = np.stack([_alone(q, k, GGMLType.F16, v, GGMLType.F16, mask, ts, 2, flash, i) for i in range(n_max)])
    pick = np.arange(n_max)[::-2]
    n_threads0 = numba.get_num_threads()
    try:
        for n_threads in (1, 2):
            numba.set_num_threads(n_threads)
            monkeypatch.setattr(parallel, "ATTN_PAR_MIN_MACS", 0)
            got = attention(
                q[pick],
                k,
                GGMLType.F16,
                v,
                GGMLType.F16,
                mask[pick],
                ts[pick],
                2,
                0.125,
                flash=flash,
                n_threads=n_threads,
            )
            np.testing.assert_array_equal(got, alone[pick])
            one = mask[-1:].copy()
            one[0, :] = -np.inf
            one[0, n_kv - 1] = 0.0  # only the last cell: a partial tile of a partial chunk
            got = attention(
                q[-1:], k, GGMLType.F16, v, GGMLType.F16, one, ts[-1:], 2, 0.125, flash=flash, n_threads=n_threads
            )
            np.testing.assert_array_equal(
                got[0], _alone(q[-1:], k, GGMLType.F16, v, GGMLType.F16, one, ts[-1:], 2, flash, 0)
            )
            monkeypatch.undo()
    finally:
        numba.set_num_threads(n_threads0)


def test_two_streams_rows_are_invariant(monkeypatch):
    """Two streams (token blocks of one token): rows match the rows computed alone."""
    import numba

    q, k, _, v, _, mask, ts = _setup("q8_0", "q8_0", 16, 9, 3, 64, 600, 600, n_stream=2, seed=31)
    alone = np.stack([_alone(q, k, GGMLType.Q8_0, v, GGMLType.Q8_0, mask, ts, 3, True, i) for i in range(16)])
    n_threads0 = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        monkeypatch.setattr(parallel, "ATTN_PAR_MIN_MACS", 0)
        for n in (1, 2, 7, 16):
            got = attention(q[-n:], k, GGMLType.Q8_0, v, GGMLType.Q8_0, mask[-n:], ts[-n:], 3, 0.125, n_threads=2)
            np.testing.assert_array_equal(got, alone[-n:])
    finally:
        numba.set_num_threads(n_threads0)


def _ring_case(flash, ring_size, n_pos, n_swa, rows, seed=31):
    """The last positions of a text of n_pos tokens with a window of n_swa, held in a cache of
    ring_size cells where position p lives in cell p % ring_size (as a sliding-window cache
    places them once it wraps). -> the attention of `rows` (positions), start at the cell of the
    oldest position each row sees."""
    rng = np.random.default_rng(seed)
    n_head, n_head_kv, dk = 4, 2, 64
    q = rng.standard_normal((n_pos, n_head, dk)).astype(np.float32)
    kx = rng.standard_normal((n_pos, n_head_kv * dk)).astype(np.float32)
    vx = rng.standard_normal((n_pos, n_head_kv * dk)).astype(np.float32)
    cell = np.full(ring_size, -1)
    for p in range(n_pos):  # later positions overwrite older ones in the ring
        cell[p % ring_size] = p
    held = cell >= 0
    k = np.zeros((ring_size, n_head_kv * dk), dtype=np.float32)
    v = np.zeros_like(k)
    k[held], v[held] = kx[cell[held]], vx[cell[held]]
    kraw, _ = _make_rows(k, "f16", rng)
    if flash:
        vraw, _ = _make_rows(v, "f16", rng)
        vraw = vraw.reshape(1, ring_size, -1)
    else:
        vraw, _ = _make_rows(np.ascontiguousarray(v.T), "f16", rng)
        vraw = vraw.reshape(1, n_head_kv * dk, -1)
    rows = np.asarray(rows)
    mask = np.full((rows.size, ring_size), -np.inf, dtype=np.float32)
    for i, p in enumerate(rows):
        mask[i, held & (cell <= p) & (cell > p - n_swa)] = 0.0
    start = (rows - n_swa + 1).clip(0) % ring_size
    ts = np.zeros(rows.size, dtype=np.int32)
    return (
        q[rows],
        kraw.reshape(1, ring_size, -1),
        GGMLType.F16,
        vraw,
        GGMLType.F16,
        mask,
        ts,
        n_head_kv,
        0.125,
    ), start


@pytest.mark.parametrize("n_pos", [300, 600])
@pytest.mark.parametrize("flash", [True, False], ids=["flash", "classic"])
def test_a_wrapped_sliding_window_ring_gives_the_bits_of_the_unwrapped_cache(flash, n_pos, monkeypatch):
    """A text of 300 / 600 positions, window 40: a 256-cell ring (wrapped once / twice) and a
    768-cell cache (never wrapped) hold the same K/V in different cells. With each row's sums
    started at the cell of its oldest position, every row of the last 76 is bit-identical
    between the two, in one call or row by row, serial, parallel or split over the cells; and
    on the unwrapped cache the start changes nothing (cell 0 gives the same bits)."""
    rows = list(range(n_pos - 76, n_pos))
    lin, s_lin = _ring_case(flash, 768, n_pos, 40, rows)
    ring, s_ring = _ring_case(flash, 256, n_pos, 40, rows)
    want = attention(*lin, flash=flash, n_threads=1, start=s_lin)
    np.testing.assert_array_equal(attention(*lin, flash=flash, n_threads=1), want)
    for n_threads, min_work in _threads_and_thresholds(monkeypatch):
        np.testing.assert_array_equal(
            attention(*ring, flash=flash, n_threads=n_threads, start=s_ring),
            want,
            err_msg=f"threads={n_threads} min_work={min_work}",
        )
        for i in (0, 20, 31, 32, 33, 50, 75):  # alone, on both sides of the wrap
            one, s_one = _ring_case(flash, 256, n_pos, 40, [rows[i]])
            np.testing.assert_array_equal(
                attention(*one, flash=flash, n_threads=n_threads, start=s_one)[0], want[i], err_msg=f"row {rows[i]}"
            )
            one, s_one = _ring_case(flash, 768, n_pos, 40, [rows[i]])  # split over 3 chunks
            np.testing.assert_array_equal(
                attention(*one, flash=flash, n_threads=n_threads, start=s_one)[0],
                want[i],
                err_msg=f"row {rows[i]}, unwrapped",
            )
    assert not np.array_equal(attention(*ring, flash=flash, n_threads=1), want)  # cell order differs


def test_vhsum16_lanes_are_the_bits_of_sixteen_separate_vhsums():
    """K·q of 16 cells is summed side by side (kernels/simd.vhsum16); each lane must be the very
    tree vhsum computes on its own, including rounding of values of wildly different sizes."""
    from numba import njit

    from kvchat.kernels.simd import vhsum, vhsum16, vload, vstore

    @njit(cache=False)
    def both(x, side, alone):  # x [16 * 16] f32 -> side [16], alone [16]
        vstore(
            side,
            0,
            vhsum16(
                vload(x, 0),
                vload(x, 16),
                vload(x, 32),
                vload(x, 48),
                vload(x, 64),
                vload(x, 80),
                vload(x, 96),
                vload(x, 112),
                vload(x, 128),
                vload(x, 144),
                vload(x, 160),
                vload(x, 176),
                vload(x, 192),
                vload(x, 208),
                vload(x, 224),
                vload(x, 240),
            ),
        )
        for i in range(16):
            alone[i] = vhsum(vload(x, 16 * i))

    rng = np.random.default_rng(3)
    side, alone = np.empty(16, np.float32), np.empty(16, np.float32)
    for _ in range(200):
        x = (rng.standard_normal(256) * np.exp(rng.uniform(-30, 30, 256))).astype(np.float32)
        both(x, side, alone)
        assert np.array_equal(side.view(np.uint32), alone.view(np.uint32))


def test_vector_exp_is_the_scalar_exp_bit_for_bit():
    """The softmax step's 16-lane exp (simd.vexp_le0) against attention_tiles.exp_le0 on every
    float32 in [-100, 0] with a stride of 97 bit patterns, plus -inf, NaN and the clamp edge."""
    from numba import njit

    from kvchat.kernels.attention_tiles import exp_le0
    from kvchat.kernels.simd import vexp_le0, vload, vstore

    @njit(cache=False)
    def both(x, vec, sca):  # x [n] f32, n a multiple of 16
        for i in range(0, x.size, 16):
            vstore(vec, i, vexp_le0(vload(x, i)))
        for i in range(x.size):
            sca[i] = exp_le0(x[i])

    bits = np.arange(0x80000000, 0xC2C80000, 97, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), np.array([-np.inf, np.nan, -87.0, -86.99999, -0.0, 0.0], np.float32)])
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])
    vec, sca = np.empty_like(x), np.empty_like(x)
    both(x, vec, sca)
    assert np.array_equal(vec.view(np.uint32), sca.view(np.uint32))


def test_underflowing_probabilities_skip_cells_and_keep_rows_invariant():
    """Heads with scores spread far beyond 87 get p = 0 cells (exp underflow), whose P·V skips
    them (tile_pv1) while the other heads of the tile share one grouped P·V pass (tile_pv):
    every row equals the row computed alone, bit for bit, and the reference."""
    q, k, kval, v, vval, mask, ts = _setup("f16", "f16", 40, 9, 3, 64, N_KV, 768, 1, seed=29)
    q[:, ::2] *= 60.0  # heads 0, 2, ..., 8: scores spread over hundreds
    tk = GGMLType.F16
    alone = np.stack([_alone(q, k, tk, v, tk, mask, ts, 3, True, i) for i in range(40)])
    for n_threads in (1, 2):
        got = attention(q, k, tk, v, tk, mask, ts, 3, 0.125, n_threads=n_threads)
        np.testing.assert_array_equal(got, alone)
    ref = _reference(q, kval, vval, mask, ts, 3, 0.125, 0.0)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
