"""The fused Q/K/V preparation + K/V cache write (kernels/qkv_store.py): bit-identical to the
unfused steps it replaces (prepare_qkv, then scatter_rows for K and for V), on the serial and
parallel twins, and batch-invariant (a token alone writes the same bytes and gets the same Q as
inside a batch)."""

import numpy as np
import pytest

from kvchat.kernels import parallel
from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.kv_kernels import scatter_rows
from kvchat.kernels.qkv_store import prepare_qkv_store
from kvchat.kernels.rope import prepare_qkv_planned, rope_plan

N_HEAD, N_HEAD_KV, DK = 6, 2, 64
KV_SIZE = 64


def _case(n, seed, qk_norm, type_k, type_v):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((n, (N_HEAD + 2 * N_HEAD_KV) * DK)) * 2).astype(np.float32)
    a, b = N_HEAD * DK, (N_HEAD + N_HEAD_KV) * DK
    q_in, k_in, v_in = qkv[:, :a], qkv[:, a:b], qkv[:, b:]  # column views, as the forward passes them
    pos = rng.integers(0, 4000, n).astype(np.int32)
    q_norm = (rng.standard_normal(DK) + 1).astype(np.float32) if qk_norm else None
    k_norm = (rng.standard_normal(DK) + 1).astype(np.float32) if qk_norm else None
    cell = rng.permutation(KV_SIZE)[:n].astype(np.int64)  # distinct slot cells
    strm = np.zeros(n, dtype=np.int64)
    k_dst = np.zeros((1, KV_SIZE, row_bytes(type_k, N_HEAD_KV * DK)), dtype=np.uint8)
    v_dst = np.zeros((1, KV_SIZE, row_bytes(type_v, N_HEAD_KV * DK)), dtype=np.uint8)
    return q_in, k_in, v_in, pos, q_norm, k_norm, strm, cell, k_dst, v_dst


def _rope_args(plan, q_norm, k_norm, neox, eps):
    one = np.ones(1, dtype=np.float32)
    has = q_norm is not None
    return (q_norm if has else one, k_norm if has else one, has, np.float64(eps), *plan, bool(neox))


CASES = [
    (GGMLType.F16, GGMLType.F16, True, True),
    (GGMLType.Q8_0, GGMLType.Q8_0, False, True),
    (GGMLType.F32, GGMLType.BF16, True, False),
    (GGMLType.Q4_0, GGMLType.F16, False, False),
]


@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("type_k,type_v,qk_norm,neox", CASES)
def test_fused_store_equals_prepare_qkv_then_scatter_rows_bit_for_bit(n, type_k, type_v, qk_norm, neox):
    q_in, k_in, v_in, pos, q_norm, k_norm, strm, cell, k_dst, v_dst = _case(n, 0, qk_norm, int(type_k), int(type_v))
    plan = rope_plan(DK, 10000.0, 1.0, np.linspace(1, 3, DK // 2).astype(np.float32), 1.0)
    q_ref, k_ref, v_ref = prepare_qkv_planned(
        q_in, k_in, v_in, N_HEAD, N_HEAD_KV, DK, pos, plan, neox, q_norm, k_norm, 1e-6
    )
    k_ref_dst, v_ref_dst = k_dst.copy(), v_dst.copy()
    scatter_rows(k_ref_dst, k_ref.reshape(n, -1), strm, cell, int(type_k))
    scatter_rows(v_ref_dst, v_ref, strm, cell, int(type_v))
    q = prepare_qkv_store(
        q_in,
        k_in,
        v_in,
        pos,
        _rope_args(plan, q_norm, k_norm, neox, 1e-6),
        N_HEAD,
        N_HEAD_KV,
        DK,
        (k_dst, v_dst, strm, cell, int(type_k), int(type_v)),
    )
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(k_dst, k_ref_dst)
    np.testing.assert_array_equal(v_dst, v_ref_dst)
    assert k_dst[0, cell].any(axis=1).all()  # every slot cell was written


@pytest.mark.parametrize("par_min", [1, 1 << 30])  # every batch on the parallel / serial twin
def test_fused_store_is_batch_invariant(monkeypatch, par_min):
    monkeypatch.setattr(parallel, "ROPE_PAR_MIN_TOKENS", par_min)
    n, tk, tv = 21, int(GGMLType.Q8_0), int(GGMLType.F16)
    q_in, k_in, v_in, pos, q_norm, k_norm, strm, cell, k_dst, v_dst = _case(n, 1, True, tk, tv)
    args = _rope_args(rope_plan(DK, 1e6, 0.5), q_norm, k_norm, True, 1e-6)
    q_all = prepare_qkv_store(q_in, k_in, v_in, pos, args, N_HEAD, N_HEAD_KV, DK, (k_dst, v_dst, strm, cell, tk, tv))
    k_one, v_one = np.zeros_like(k_dst), np.zeros_like(v_dst)
    for t in range(n):
        q_t = prepare_qkv_store(
            q_in[t : t + 1],
            k_in[t : t + 1],
            v_in[t : t + 1],
            pos[t : t + 1],
            args,
            N_HEAD,
            N_HEAD_KV,
            DK,
            (k_one, v_one, strm[t : t + 1], cell[t : t + 1], tk, tv),
        )
        np.testing.assert_array_equal(q_t[0], q_all[t])
    np.testing.assert_array_equal(k_one, k_dst)
    np.testing.assert_array_equal(v_one, v_dst)
