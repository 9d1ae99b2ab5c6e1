"""QMatrix.matmul / get_rows against gguf-py's reference dequantization, every weight type, and
the batch invariance of matmul: row t of W.matmul(x) is bit-identical to W.matmul(x[t:t+1])[0]
whatever n, the other rows of x, the token chunk and the thread count.

Tolerance: float weights are multiplied in float32 (kernels/matmul_kernels.py: per block
s_a + s_b fma chains, accumulated in one fixed order); block-quantized weights by exact integer
block dots on activations quantized as ggml does (kernels/matmul_int.py), so their reference is
the float64 product of the dequantized weights with those quantized activations
(tests/helpers/qref.py). The classic bound for a float sum of k products is
|err| <= gamma_{k+2} * sum_i |x_i w_i| with gamma_j = j * eps / (1 - j * eps); the decode or
the scale steps add at most two roundings per term. So we assert
    |y - ref| <= (k + 4) * eps32 * (|x| @ |W|.T)
computed in float64 — a proven bound, not a fitted one (typical errors are ~100x below it).
tests/test_matmul_int.py covers the integer kernel's paths in detail.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from kvchat.kernels.ggml_types import GGMLType, row_bytes, type_info
from kvchat.kernels.matmul import QMatrix

EPS32 = float(np.finfo(np.float32).eps)

# byte offsets of the float16 scale fields inside one block (random bytes elsewhere are valid)
F16_FIELDS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.MXFP4: (),  # its scale is an e8m0 exponent byte (random_raw)
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
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
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(m, nb, 2)
    if t == GGMLType.MXFP4:  # scales 2^(e - 128) in 2^-10 .. 2^-2
        raw[:, :, 0] = rng.integers(118, 127, (m, nb), dtype=np.uint8)
    return raw.reshape(m, nb * info.type_size)


def reference(raw: np.ndarray, t: GGMLType, k: int) -> np.ndarray:
    return np.asarray(gguf_dequantize(raw, t), np.float64).reshape(raw.shape[0], k)


def assert_matmul_close(qm: QMatrix, w: np.ndarray, x: np.ndarray) -> None:
    from tests.helpers.qref import int_matmul_reference

    y = qm.matmul(x)  # [n, m]
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == np.float32
    if qm.fmt is not None:  # integer kernel: the product with ggml's quantized activations
        ref, base = int_matmul_reference(np.ascontiguousarray(qm.raw), qm.t, qm.k, x)
    else:
        x64 = x.astype(np.float64)
        ref, base = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    bound = (qm.k + 4) * EPS32 * base
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
    for n in (1, 3, 17, 64):  # decode in registers below 4 tokens, a decoded block shared above
        x = rng.standard_normal((n, k)).astype(np.float32)
        assert_matmul_close(qm, w, x)


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


def test_work_split_covers_every_row_and_does_not_change_results(monkeypatch):
    """Work items are (32-row group, token chunk) pairs, the last of each partial, cut into runs
    of consecutive items for the threads. Chunk size and runs decide only which item computes
    an element, never its value (float layout here; the integer kernel in test_matmul_int)."""
    import kvchat.kernels.matmul as mm
    from kvchat.kernels.matmul_kernels import matmul_blocks, matmul_blocks_serial

    raw = random_raw(GGMLType.F16, 32 * 5 + 3, 64, seed=4)
    qm = QMatrix(raw, GGMLType.F16, 64)
    x = np.random.default_rng(5).standard_normal((21, 64)).astype(np.float32)
    want = qm.matmul(x)
    assert_matmul_close(qm, reference(raw, GGMLType.F16, 64), x)
    for chunk in (1, 4, 5, 8, 21, 64):
        monkeypatch.setattr(mm, "TOKEN_CHUNK", chunk)
        assert np.array_equal(qm.matmul(x), want), f"token chunk {chunk} changed the result"
    for runs in (1, 2, 3, 7, 1000):
        y = np.full_like(want, np.nan)
        matmul_blocks(*qm._packed, x, y, 8, runs)
        assert np.array_equal(y, want), f"{runs} runs changed the result"
    y = np.full_like(want, np.nan)
    matmul_blocks_serial(*qm._packed, x, y, 8)  # the serial twin (small products)
    assert np.array_equal(y, want)


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
    from kvchat.runtime.gguf.file import GGUFFile

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
        _assert_rows_equal(qm.matmul(x), np.stack([qm.matmul(r) for r in x]), name)  # batch invariant
        ids = np.array([0, raw.shape[0] - 1, 5], np.int32)
        np.testing.assert_array_equal(qm.get_rows(ids), w[ids].astype(np.float32), err_msg=name)


def test_f16_scale_decode_is_exact_for_every_half():
    """The kernels widen f16 block scales with simd.vload on u16 bits: all 65536 of them, bit for bit."""
    from numba import njit

    from kvchat.kernels.simd import vload, vstore

    @njit(cache=False)
    def widen(a, out):
        for i in range(0, a.shape[0], 16):
            vstore(out, i, vload(a, i))

    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    widen(h, got)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()


def test_vector_transposes_copy_16_by_16_blocks_exactly():
    """kernels/simd.vtranspose16 (f32) and vtranspose16_f16 (f16 bytes at byte offsets, any
    stride) copy a 16 x 16 block transposed, every value exact (the ggml-order flash kernel's K tiles)."""
    from numba import njit

    from kvchat.kernels.simd import vtranspose16, vtranspose16_f16

    @njit
    def f32(a, b):
        vtranspose16(a, 3 * 40 + 5, 40, b, 2 * 70 + 1, 70)

    @njit
    def f16(a, b):
        vtranspose16_f16(a, 3 * 90 + 10, 90, b, 1, 70)

    rng = np.random.default_rng(7)
    a = rng.standard_normal((30, 40)).astype(np.float32)
    b = np.zeros((30, 70), np.float32)
    f32(a, b)
    want = np.zeros_like(b)
    want[2:18, 1:17] = a[3:19, 5:21].T
    np.testing.assert_array_equal(b, want)
    h = rng.standard_normal((30, 45)).astype(np.float16)  # rows of 90 bytes
    b = np.zeros((30, 70), np.float32)
    f16(h.view(np.uint8), b)
    want = np.zeros_like(b)
    want[0:16, 1:17] = h[3:19, 5:21].T.astype(np.float32)
    np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize("t", [t for t in F16_FIELDS if t != GGMLType.MXFP4], ids=lambda t: t.name)
def test_packed_layout_holds_the_file_bytes_once_with_f16_scales(t):
    """The integer layout keeps the file's f16 scales as 2-byte patterns, no offset array for
    the symmetric formats, and 4-bit values two per byte (q4_0 / q4_1 / q8_0: exactly the file's
    bytes; q4_K: +4 bytes per super-block for unpacked 6-bit scales and mins)."""
    k = 512 if type_info(t).block_size == 256 else 64
    m = 64
    raw = random_raw(t, m, k, seed=7)
    qm = QMatrix(raw, t, k)
    q, d, mm, sc, mn = qm._packed
    assert d.dtype == np.uint16 and (mm.size == 0 or mm.dtype == np.uint16)
    symmetric = t in (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.IQ4_NL, GGMLType.Q6_K, GGMLType.Q3_K, GGMLType.Q4_0)
    assert (mm.size == 0) == symmetric
    assert q.nbytes == (m * k // 2 + m * k * qm.fmt.planes // 8 if qm.fmt.nib else m * k)  # + bit planes
    if t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0):
        assert qm.packed_nbytes == raw.nbytes
    if t == GGMLType.Q4_K:
        assert qm.packed_nbytes == raw.nbytes + 4 * m * (k // 256)


def test_mxfp4_is_held_in_its_files_bytes_codes_as_nibbles_and_exponent_bytes_as_scales():
    """mxfp4: the file's 16 code bytes and 1 exponent byte of every block, moved, nothing widened
    (the kernel maps the codes to ggml's doubled e2m1 values and reads e as 2^(e - 128))."""
    k, m = 64, 64
    raw = random_raw(GGMLType.MXFP4, m, k, seed=7)
    qm = QMatrix(raw, GGMLType.MXFP4, k)
    q, d, mm, sc, mn = qm._packed
    assert q.dtype == np.uint8 and d.dtype == np.uint8 and mm.size == sc.size == mn.size == 0
    assert qm.packed_nbytes == raw.nbytes
    blocks = raw.reshape(m, 2, 17)
    np.testing.assert_array_equal(d[1, :, :].T, blocks[32:, :, 0])  # group 1's rows 32..63, block by block
    # row 33's code bytes 4 s .. 4 s + 3 of block 1 sit at step s, lane 1 of group 1
    np.testing.assert_array_equal(q[1, 1].reshape(4, 32, 4)[:, 1].reshape(-1), blocks[33, 1, 1:])


# ---- batch invariance: every output element computed the same way whatever the batch ----------

INVARIANCE_NS = (1, 2, 3, 4, 5, 7, 8, 9, 64, 513)
MODEL_KS = (576, 1536, 640, 2048)  # SmolLM2 n_embd / n_ff, Gemma-3 n_embd / n_ff


def _thread_counts():
    return sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)})


def _with_threads(n_threads, f):
    old = numba.get_num_threads()
    numba.set_num_threads(n_threads)
    try:
        return f()
    finally:
        numba.set_num_threads(old)


def _assert_rows_equal(got, want, what):
    same = np.all(got == want, axis=1) | np.all(np.isnan(got) & np.isnan(want), axis=1)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (
        f"{what}: {bad.size} rows differ, first row {bad[0]}, max |diff| "
        f"{np.max(np.abs(got[bad[0]] - want[bad[0]])):.3g}"
    )


def _invariance_cases():
    for t in ALL_TYPES:
        for k in MODEL_KS:
            if k % type_info(t).block_size == 0:
                yield pytest.param(t, k, id=f"{t.name}-k{k}")


def test_invariance_cases_cover_every_layout():
    """Nibbles, unsigned and signed bytes, legacy and K-quant scales, both offset terms, and the
    float layout are all in the batch-invariance cases."""
    seen = set()
    for p in _invariance_cases():
        t, k = p.values
        qm = QMatrix(random_raw(t, 33, k), t, k)
        f = qm.fmt
        seen.add("f32" if f is None else (f.nib, f.signed, f.n_sub > 1, f.lmin, f.kmin, f.planes))
    # every unsigned format is nibbles now, with 0, 1 or 2 bit planes (kernels/qlayout.py)
    assert {
        "f32",
        (True, False, False, True, False, 0),
        (True, False, False, False, False, 0),
        (True, False, False, True, False, 1),
        (True, False, False, False, False, 1),
        (False, True, False, False, False, 0),
        (True, False, True, False, True, 0),
        (True, False, True, False, True, 1),
        (True, False, True, False, False, 2),
        (True, False, True, False, False, 0),
    } <= seen


@pytest.mark.parametrize("t,k", list(_invariance_cases()))
def test_matmul_rows_are_batch_invariant(t, k):
    """array_equal, not allclose: W.matmul(x)[i] == W.matmul(x[i:i+1])[0] for every row i, for
    n in INVARIANCE_NS, with 1 and 2 threads, and whatever the other rows are."""
    m = 75  # not a multiple of the 32-row groups
    qm = QMatrix(random_raw(t, m, k, seed=k), t, k)
    rng = np.random.default_rng(k + int(t))
    n_max = max(INVARIANCE_NS)
    x = (rng.standard_normal((n_max, k)) * rng.uniform(0.05, 30.0, (n_max, 1))).astype(np.float32)
    single = _with_threads(1, lambda: np.stack([qm.matmul(x[i : i + 1])[0] for i in range(n_max)]))  # [513, m]
    for n_threads in _thread_counts():
        for n in INVARIANCE_NS:
            got = _with_threads(n_threads, lambda: qm.matmul(x[:n]))
            _assert_rows_equal(got, single[:n], f"{t.name} k={k} n={n} threads={n_threads}")
        idx = rng.integers(0, n_max, 9)  # other neighbours, repeats, another order
        got = _with_threads(n_threads, lambda: qm.matmul(x[idx]))
        _assert_rows_equal(got, single[idx], f"{t.name} k={k} shuffled rows threads={n_threads}")
    np.testing.assert_array_equal(qm.matmul(x[7]), single[7])  # 1-D x
    w = reference(qm.raw, t, k)
    assert_matmul_close(qm, w, x[:9])


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_rows_not_a_multiple_of_32(t):
    """Float weights with k = 45 are padded to whole 32-blocks (weights and x): exact and invariant."""
    k, m = 45, 40
    raw = random_raw(t, m, k, seed=11)
    qm = QMatrix(raw, t, k)
    x = np.random.default_rng(12).standard_normal((9, k)).astype(np.float32)
    assert_matmul_close(qm, reference(raw, t, k), x)
    _assert_rows_equal(qm.matmul(x), np.stack([qm.matmul(r) for r in x]), f"{t.name} k=45")


@pytest.mark.parametrize("t", [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_half_weights_are_held_in_their_two_bytes_and_multiply_as_their_f32_values(t):
    """An F16 or BF16 matrix keeps its file's 2-byte values (interleaved, zero-padded to whole
    32-blocks and row groups), not a widened f32 copy, and every product equals, bit for bit,
    the one of an F32 matrix holding the same values (the kernel widens each vector exactly)."""
    k, m = 70, 75
    raw = random_raw(t, m, k, seed=21)
    qm = QMatrix(raw, t, k)
    w32 = reference(raw, t, k).astype(np.float32)  # [m, k], exact
    qm32 = QMatrix(w32.view(np.uint8).reshape(m, -1), GGMLType.F32, k)
    q, q32 = qm._packed[0], qm32._packed[0]
    assert qm.kind == t.name.lower() and q.itemsize == 2 and q.shape == q32.shape  # [G, nb, 32, R]
    assert qm.packed_nbytes * 2 == qm32.packed_nbytes == 3 * 3 * 32 * 32 * 4
    x = np.random.default_rng(22).standard_normal((64, k)).astype(np.float32)
    for n in (1, 2, 3, 4, 7, 64):
        np.testing.assert_array_equal(qm.matmul(x[:n]), qm32.matmul(x[:n]))
        np.testing.assert_array_equal(qm.matmul(x[:n], min_macs=0), qm32.matmul(x[:n]))  # the parallel twin


def test_interleave_in_slices_equals_the_whole_matrix_at_once(monkeypatch):
    """The row interleave built in slices (bounded scratch) lays out exactly what one pass over the
    whole padded matrix does, also where a slice ends inside the last row group."""
    from kvchat.kernels import repack

    a = np.random.default_rng(23).standard_normal((200, 2, 32)).astype(np.float32)
    pad = np.zeros((224, 2, 32), np.float32)  # 7 groups of 32 rows
    pad[:200] = a
    whole = np.moveaxis(pad.reshape(7, 32, 2, 32), 1, -1)
    np.testing.assert_array_equal(repack._interleave(a, 200), whole)
    monkeypatch.setattr(repack, "ROWS_PER_SLICE", 64)
    np.testing.assert_array_equal(repack._interleave(a, 200), whole)
