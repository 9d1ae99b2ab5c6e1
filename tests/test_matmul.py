"""QMatrix.matmul / get_rows against gguf-py's reference dequantization, every weight type.

Tolerance: the kernels compute in float32 (values decoded as d * q + mn, dot products
accumulated in float32 in any order, fastmath). The classic bound for a float sum of k
products is |err| <= gamma_{k+2} * sum_i |x_i w_i| with gamma_j = j * eps / (1 - j * eps);
the decode adds at most two roundings per weight. So we assert
    |y - x @ W.T| <= (k + 4) * eps32 * (|x| @ |W|.T)
computed in float64 — a proven bound, not a fitted one (typical errors are ~100x below it).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from kernels.ggml_types import GGMLType, row_bytes, type_info
from kernels.matmul import GEMM_MIN_TOKENS, QMatrix

EPS32 = float(np.finfo(np.float32).eps)

# byte offsets of the float16 scale fields inside one block (random bytes elsewhere are valid)
F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.IQ4_NL: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
ALL_TYPES = list(FLOAT_TYPES) + list(F16_FIELDS)


def random_raw(t: GGMLType, m: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [m, row_bytes]: random blocks of type t with finite, modest scales."""
    rng = np.random.default_rng(seed)
    if t in FLOAT_TYPES:
        w = rng.standard_normal((m, k)).astype(np.float32)
        if t == GGMLType.F32:
            return w.view(np.uint8).reshape(m, -1)
        if t == GGMLType.F16:
            return w.astype(np.float16).view(np.uint8).reshape(m, -1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(m, -1)
    info = type_info(t)
    nb = k // info.block_size
    raw = rng.integers(0, 256, (m, nb, info.type_size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        scale = (rng.random((m, nb)) * 0.02 + 0.001).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * info.type_size)


def reference(raw: np.ndarray, t: GGMLType, k: int) -> np.ndarray:
    return np.asarray(gguf_dequantize(raw, t), np.float64).reshape(raw.shape[0], k)


def assert_matmul_close(qm: QMatrix, w: np.ndarray, x: np.ndarray) -> None:
    y = qm.matmul(x)  # [n, m]
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == np.float32
    x64 = x.astype(np.float64)
    ref = x64 @ w.T
    bound = (qm.k + 4) * EPS32 * (np.abs(x64) @ np.abs(w).T)
    err = np.abs(y - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_dequantized_reference(t):
    k = 512 if type_info(t).block_size == 256 else 160
    m = 75  # odd, not a multiple of the 32-row interleave
    raw = random_raw(t, m, k)
    qm = QMatrix(raw, t, k)
    w = reference(raw, t, k)
    assert (qm.m, qm.k, qm.t, qm.nbytes) == (m, k, int(t), raw.nbytes)
    rng = np.random.default_rng(1)
    for n in (1, 3, 17, 64):  # gemv path below GEMM_MIN_TOKENS, panel + sgemm above
        x = rng.standard_normal((n, k)).astype(np.float32)
        assert_matmul_close(qm, w, x)
    assert GEMM_MIN_TOKENS <= 17


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_exact(t):
    k = 512 if type_info(t).block_size == 256 else 96
    raw = random_raw(t, 41, k, seed=2)
    qm = QMatrix(raw, t, k)
    ids = np.array([0, 40, 7, 7, 13], np.int32)
    got = qm.get_rows(ids)
    assert got.dtype == np.float32 and got.shape == (5, k)
    np.testing.assert_array_equal(got, reference(raw, t, k)[ids].astype(np.float32))


def test_one_dimensional_x_and_tiny_matrix():
    raw = random_raw(GGMLType.Q4_1, 1, 32, seed=3)
    qm = QMatrix(raw, GGMLType.Q4_1, 32)
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    y = qm.matmul(x)
    assert y.shape == (1,)
    assert_matmul_close(qm, reference(raw, GGMLType.Q4_1, 32), x[None, :])


def test_panels_cover_every_row(monkeypatch):
    """Prefill splits the rows into several panels; the last one is partial."""
    import kernels.matmul as mm

    monkeypatch.setattr(mm, "PANEL_BYTES", 4 * 64 * 32 * 2)  # two row groups per panel
    raw = random_raw(GGMLType.Q8_0, 32 * 5 + 3, 64, seed=4)
    qm = QMatrix(raw, GGMLType.Q8_0, 64)
    x = np.random.default_rng(5).standard_normal((20, 64)).astype(np.float32)
    assert_matmul_close(qm, reference(raw, GGMLType.Q8_0, 64), x)


def test_bad_input_is_rejected():
    raw = random_raw(GGMLType.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="needs 68"):
        QMatrix(raw[:, :34], GGMLType.Q8_0, 64)
    qm = QMatrix(raw, GGMLType.Q8_0, 64)
    with pytest.raises(ValueError, match="k=64"):
        qm.matmul(np.zeros((1, 32), np.float32))
    with pytest.raises(IndexError):
        qm.get_rows(np.array([4], np.int32))
    assert row_bytes(GGMLType.Q8_0, 64) == 68


def _real_tensors(path):
    """One 2-D tensor per weight type of a real model: name -> (raw rows, type, k)."""
    from runtime.gguf_file import GGUFFile

    gf = GGUFFile(path)
    picked = {}
    for name, ti in gf.tensors.items():
        if len(ti.shape) == 2 and ti.ggml_type not in picked:
            picked[ti.ggml_type] = (name, ti.data[:2048], ti.ggml_type, int(ti.shape[0]))
    return picked


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_real_model_tensors(model, request):
    path = request.getfixturevalue(model)
    picked = _real_tensors(path)
    assert picked, "no 2-D tensors found"
    rng = np.random.default_rng(6)
    for t, (name, raw, tt, k) in picked.items():
        qm = QMatrix(raw, tt, k)
        w = reference(np.ascontiguousarray(raw), GGMLType(tt), k)
        for n in (1, 17):
            x = rng.standard_normal((n, k)).astype(np.float32)
            assert_matmul_close(qm, w, x)
        ids = np.array([0, raw.shape[0] - 1, 5], np.int32)
        np.testing.assert_array_equal(qm.get_rows(ids), w[ids].astype(np.float32), err_msg=name)


def test_f16_scale_decode_is_exact_for_every_half():
    """scale_f32 widens f16 bit patterns inside the kernels: all 65536 of them, bit for bit."""
    from numba import njit

    from kernels.matmul_kernels import scale_f32

    @njit(cache=False)
    def widen(a, out):
        for i in range(a.shape[0]):
            out[i] = scale_f32(a[i])

    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    widen(h, got)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.IQ4_NL, GGMLType.Q6_K, GGMLType.Q3_K,
                               GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_1],
                         ids=lambda t: t.name)
def test_packed_layout_streams_no_zero_offsets_and_f16_scales(t):
    """Symmetric formats keep no offset array; formats with f16 scales in the file keep 2-byte scales."""
    k = 512 if type_info(t).block_size == 256 else 64
    m = 64
    qm = QMatrix(random_raw(t, m, k, seed=7), t, k)
    q, d, mn = qm._packed
    symmetric = t in (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.IQ4_NL, GGMLType.Q6_K, GGMLType.Q3_K)
    assert (mn.size == 0) == symmetric
    if type_info(t).block_size == 32:
        assert d.dtype == np.uint16 and (mn.size == 0 or mn.dtype == np.uint16)
        values_bytes = m * k if qm.kind == "i8" else m * k // 2
        assert qm.packed_nbytes == values_bytes + (2 if symmetric else 4) * m * (k // 32)


def test_scale_overflowing_f16_falls_back_to_f32():
    """q4_0's offset -8 d overflows f16 for d > 8188: the repack keeps f32 scales and stays exact."""
    raw = random_raw(GGMLType.Q4_0, 33, 64, seed=8)
    raw[5, 0:2] = np.array([30000.0], np.float16).view(np.uint8)  # d = 30000, -8 d = -240000
    qm = QMatrix(raw, GGMLType.Q4_0, 64)
    assert qm._packed[1].dtype == np.float32
    x = np.random.default_rng(9).standard_normal((2, 64)).astype(np.float32)
    assert_matmul_close(qm, reference(raw, GGMLType.Q4_0, 64), x)
    assert_matmul_close(qm, reference(raw, GGMLType.Q4_0, 64), np.tile(x, (6, 1)))
