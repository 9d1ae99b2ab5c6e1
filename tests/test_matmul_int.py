"""The integer matmul (kernels/matmul_int.py) on every weight type and every CPU path this machine runs.

- the activations are quantized bit for bit as ggml's x86 build does (tests/helpers/qref.py);
- the product equals gguf-py's dequantized weights times those activations, computed in
  float64, up to the float order of the per-block scale steps: |err| <= (k + 4) eps32 |x̂|·|W|
  (a proven bound for k accumulations of one rounding each, as in tests/test_matmul.py);
- every path (vnni512, vnni256, avx2, portable) gives the same bits;
- a token's row is bit-identical whatever else is in the batch, the thread count, the token
  chunk, and whether the serial or the parallel driver ran.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from kvchat.kernels.cpu import select_isa, supported_isas
from kvchat.kernels.ggml_types import GGMLType, type_info
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.matmul_int import matmul_q, matmul_q_serial
from kvchat.kernels.matmul_int import quantize_activations as quantize_rows
from kvchat.kernels.qlayout import ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, FORMATS
from kvchat.kernels.simd_int import Isa
from tests.helpers.qref import (
    ggml_q0_q8_0_batch,
    ggml_q4_1_q8_1,
    ggml_q4_K_repacked,
    ggml_q6_K_tiled,
    int_matmul_reference,
    quantize_act,
)
from tests.test_matmul import random_raw

EPS32 = float(np.finfo(np.float32).eps)
QTYPES = list(FORMATS)
ISAS = supported_isas()
# the other paths are tested on one type of each code shape (nibbles / unsigned bytes / signed
# bytes / table nibbles, legacy / K-quant / exponent scales, both offset terms): each (path, type)
# is a compilation
SHAPE_TYPES = (GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.MXFP4)


def _path_cases():
    for t in QTYPES:
        for isa in ISAS:
            if isa == ISAS[0] or t in SHAPE_TYPES:
                yield pytest.param(t, isa, id=f"{t.name}-{isa}")


def _k(t):
    return 512 if type_info(t).block_size == 256 else 160


def _run(qm, x, isa, serial=False, chunk=32, runs=8):
    y = np.full((x.shape[0], qm.m), np.nan, np.float32)
    if serial:
        matmul_q_serial(Isa(isa), qm.fmt, *qm._packed, x, y, chunk)
    else:
        matmul_q(Isa(isa), qm.fmt, *qm._packed, x, y, chunk, runs)
    return y


@pytest.mark.parametrize("act", [ACT_Q8_0, ACT_Q8_1, ACT_Q8_K], ids=["q8_0", "q8_1", "q8_K"])
def test_activation_quantization_is_ggmls_bit_for_bit(act):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 512)) * rng.uniform(0.01, 50, (7, 1))).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero block (d = 0, q = 0)
    x[2, 40:72] = np.float32(0.5) * np.arange(32, dtype=np.float32) / 31  # values on exact .5 ties
    x[3, 256:512] = -x[3, 256:512]
    x[4, 5] = -1e4  # the largest |x| negative
    q, d, s16, s = quantize_act(x, act)
    gq, gd, gs16, gs = quantize_rows(x, act)
    np.testing.assert_array_equal(gq, q)
    np.testing.assert_array_equal(gd, d)
    np.testing.assert_array_equal(gs16, s16)
    if act == ACT_Q8_1:
        np.testing.assert_array_equal(gs, s)


@pytest.mark.parametrize("t,isa", list(_path_cases()))
def test_integer_matmul_matches_float64_product_of_dequantized_values(t, isa):
    k, m = _k(t), 75  # 75 rows: not a multiple of the 32-row groups
    raw = random_raw(t, m, k)
    qm = QMatrix(raw, t, k)
    x = (np.random.default_rng(1).standard_normal((5, k)) * 3).astype(np.float32)
    y = _run(qm, x, isa, serial=isa != ISAS[0])
    ref, base = int_matmul_reference(raw, t, k, x)
    err = np.abs(y - ref)
    bound = (k + 4) * EPS32 * base
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{t.name}/{isa}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


@pytest.mark.parametrize("t", SHAPE_TYPES, ids=lambda t: t.name)
def test_every_cpu_path_gives_the_same_bits(t):
    k = _k(t)
    qm = QMatrix(random_raw(t, 40, k, seed=5), t, k)
    x = (np.random.default_rng(6).standard_normal((3, k)) * 10).astype(np.float32)
    want = _run(qm, x, ISAS[0], serial=True)
    for isa in ISAS[1:]:
        np.testing.assert_array_equal(_run(qm, x, isa, serial=True), want, err_msg=f"{t.name}: {isa} vs {ISAS[0]}")


def assert_in_ggml_order(qm, default, x, want, alone, default_differs=True):
    """qm (a QMatrix in a ggml order) gives want bit for bit on every instruction path, whatever
    the token chunk and run split, and rows `alone` by themselves as in the batch; `default` (the
    same rows in kvchat's order) agrees to the last bits (and differs in them: default_differs)."""
    for isa in ISAS:  # every instruction path
        np.testing.assert_array_equal(_run(qm, x, isa, serial=True), want, err_msg=isa)
    for chunk, runs in ((32, 8), (1, 3), (5, 1)):
        np.testing.assert_array_equal(_run(qm, x, ISAS[0], chunk=chunk, runs=runs), want)
    for i in alone:  # alone: the bits it has in the batch
        np.testing.assert_array_equal(_run(qm, x[i : i + 1], ISAS[0], serial=True), want[i : i + 1])
    old = _run(default, x, ISAS[0])  # the default order: same values up to the last bits
    if default_differs:
        assert not np.array_equal(old, want)
    np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_q4_1_in_ggmls_order_is_llama_cpps_product_bit_for_bit():
    """KVCHAT_GGML_ORDER's q4_1 (QFormat.lanes, kernels/matmul_lanes.py) follows the float order of
    ggml_vec_dot_q4_1_q8_1's AVX2 code, which llama.cpp runs on every x86 CPU with AVX2: every
    output bit-identical to the emulation (tests/helpers/qref.py), for one token and in a batch,
    whatever the token chunk, run split or driver (batch invariance)."""
    t, k, m = GGMLType.Q4_1, 576, 75
    raw = random_raw(t, m, k, seed=11)
    blocks = raw.reshape(m, k // 32, 20)
    rng = np.random.default_rng(12)
    mw = (rng.standard_normal((m, k // 32)) * 0.05).astype(np.float16)  # offsets of both signs, as in real files
    blocks[:, :, 2:4] = mw.view(np.uint8).reshape(m, k // 32, 2)
    qm = QMatrix(raw, t, k)
    qm.fmt = qm.fmt._replace(lanes=True)
    x = (rng.standard_normal((9, k)) * rng.uniform(0.05, 30.0, (9, 1))).astype(np.float32)
    want = ggml_q4_1_q8_1(raw, x)
    assert_in_ggml_order(qm, QMatrix(raw, t, k), x, want, alone=(0, 4, 8), default_differs=False)


@pytest.mark.parametrize("k", [640, 608])  # 608: 19 blocks, the last one's lane corrections word by word
@pytest.mark.parametrize("t", [GGMLType.Q5_0, GGMLType.Q8_0], ids=lambda t: t.name)
def test_q5_0_and_q8_0_in_tinyblas_order_are_llama_cpps_batch_product_bit_for_bit(t, k):
    """KVCHAT_GGML_ORDER's q5_0 / q8_0 (QFormat.lanes, kernels/matmul_lanes.py) follow the float
    order of llamafile's tinyBLAS_Q0_AVX, which llama.cpp runs on x86 for a batch of >= 2 tokens
    (perplexity's ubatches): every output bit-identical to the emulation (tests/helpers/qref.py)
    on every instruction path, for one token and in a batch, whatever the token chunk, run split
    or driver (batch invariance)."""
    m = 75  # k 640: Gemma-3 270m's width; 75 rows: a partial last group
    raw = random_raw(t, m, k, seed=13)
    qm = QMatrix(raw, t, k)
    qm.fmt = qm.fmt._replace(lanes=True)
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((9, k)) * rng.uniform(0.05, 30.0, (9, 1))).astype(np.float32)
    x[3, 64:96] = 0.0  # an all-zero activation block (d 0)
    want = ggml_q0_q8_0_batch(raw, t, x)
    assert_in_ggml_order(qm, QMatrix(raw, t, k), x, want, alone=(0, 3, 8))


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_k_quants_in_the_batch_order_of_llama_cpp_are_its_product_bit_for_bit(t):
    """KVCHAT_GGML_ORDER's q4_K and q6_K (QFormat.lanes: kernels/matmul_int._row4_km, _row4_tl)
    follow the float order llama.cpp takes on x86 for a prompt's batch: the repacked q4_K gemm
    (CPU_REPACK, 4 tokens and more) and the tiled q6_K matmul (tiled.cpp, 8 tokens and more):
    every output bit-identical to the emulations (tests/helpers/qref.py) on every instruction
    path, for one token and in a batch, whatever the token chunk, run split or driver (batch
    invariance)."""
    k, m = 1024, 75
    raw = random_raw(t, m, k, seed=15)
    qm = QMatrix(raw, t, k)
    qm.fmt = qm.fmt._replace(lanes=True)
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((9, k)) * rng.uniform(0.05, 30.0, (9, 1))).astype(np.float32)
    want = ggml_q4_K_repacked(raw, x) if t == GGMLType.Q4_K else ggml_q6_K_tiled(raw, x)
    assert_in_ggml_order(qm, QMatrix(raw, t, k), x, want, alone=(0, 4, 8))


def test_this_machine_runs_every_path_it_claims():
    """The paths are real: this machine (AVX512-VNNI, AVX-VNNI) runs all four in the tests above."""
    assert ISAS[-1] == "portable"
    assert set(ISAS) <= {"vnni512", "vnni256", "avx2", "portable"}


@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_rows_are_batch_invariant_across_drivers_threads_and_chunks(t):
    k = _k(t)
    qm = QMatrix(random_raw(t, 70, k, seed=7), t, k)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((67, k)) * rng.uniform(0.05, 30.0, (67, 1))).astype(np.float32)
    single = np.stack([_run(qm, x[i : i + 1], ISAS[0], serial=True)[0] for i in range(67)])
    old = numba.get_num_threads()
    try:
        for nt in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(nt)
            for n in (1, 2, 3, 6, 16, 17, 67):
                np.testing.assert_array_equal(_run(qm, x[:n], ISAS[0]), single[:n], err_msg=f"n={n} threads={nt}")
            for chunk, runs in ((1, 3), (5, 1), (64, 1000)):
                np.testing.assert_array_equal(_run(qm, x, ISAS[0], chunk=chunk, runs=runs), single)
            idx = rng.integers(0, 67, 9)
            np.testing.assert_array_equal(_run(qm, x[idx], ISAS[0], serial=True), single[idx])
    finally:
        numba.set_num_threads(old)
    np.testing.assert_array_equal(qm.matmul(x[3]), single[3])  # the QMatrix entry point, 1-D x


def test_isa_selection_follows_the_cpu_and_the_environment():
    vnni = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"}
    assert supported_isas(vnni) == ["vnni512", "vnni256", "avx2", "portable"]
    assert supported_isas({"avx2", "avxvnni"}) == ["vnni256", "avx2", "portable"]
    assert supported_isas({"sse4.2"}) == ["portable"]
    assert select_isa("", vnni).name == "vnni512"
    assert select_isa("AVX2", vnni).name == "avx2"
    assert select_isa("", {"avx2"}).name == "avx2"
    with pytest.raises(ValueError, match="lacks"):
        select_isa("vnni512", {"avx2"})
    with pytest.raises(ValueError, match="one of"):
        select_isa("sse9", vnni)


def test_forced_path_is_used_by_a_fresh_process(tmp_path):
    """KVCHAT_ISA picks the path at start-up; the default is the fastest the CPU has."""
    import os
    import subprocess
    import sys

    code = "from kvchat.kernels.cpu import ISA; print(ISA.name)"
    env = dict(os.environ, KVCHAT_ISA="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "portable"
    env["KVCHAT_ISA"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ISAS[0]
