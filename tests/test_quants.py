"""kernels/ggml_types.py and kernels/quants*.py against ggml.

Three references:
- gguf.quants (gguf-py's numpy port): dequantize for every format, quantize where it has one
  (f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0);
- ggml itself: ggml/src/ggml-quants.c from the llama.cpp source tree compiled into a small
  shared library (skipped when the tree or a C compiler is missing) — the only oracle for the
  iq4_nl and q8_1 quantizers, and the source of realistic q2_K / q3_K / q5_K blocks;
- the formats' error bounds, for round trips.
Exactness: quantized bytes must be identical; dequantized floats within 1 ulp (fastmath may
fuse x*d + m).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest
from numba import njit

from kvchat.kernels import quants as Q
from kvchat.kernels.ggml_types import (
    KV_CACHE_TYPES,
    TYPES,
    UNSUPPORTED_TYPES,
    GGMLType,
    cache_type_by_name,
    row_bytes,
    type_by_name,
    type_info,
    type_name,
)

T = GGMLType
ROOT = Path(__file__).resolve().parent.parent
CACHE_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL]
GQ_QUANTIZES = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
FMT = {t: type_info(t).name for t in TYPES}


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between two float32 arrays (NaN-free)."""
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude -> monotonic
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max()) if ia.size else 0


def cases(n_cols: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Named f32 [n_rows, n_cols] inputs, including the edge cases."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((16, n_cols)).astype(np.float32)
    normal *= rng.uniform(1e-3, 20.0, (16, 1)).astype(np.float32)
    heavy = (rng.standard_t(2, (8, n_cols)) * 0.05).astype(np.float32)  # outliers per block
    ties = (rng.integers(-16, 17, (8, n_cols)) * 0.25).astype(np.float32)  # on grid points
    return {
        "normal": normal,
        "heavy_tailed": heavy,
        "grid_ties": ties,
        "zeros": np.zeros((2, n_cols), np.float32),
        "constant": np.full((2, n_cols), 3.25, np.float32),
        "negative_only": -np.abs(normal[:4]) - 0.5,
        "positive_only": np.abs(normal[:4]) + 0.5,
        "large": (rng.standard_normal((4, n_cols)) * 2.0e4).astype(np.float32),
        "tiny": (rng.standard_normal((4, n_cols)) * 1e-6).astype(np.float32),
        "one_spike": np.where(np.arange(n_cols) % 32 == 7, 50.0, 0.01).astype(np.float32)[None],
    }


# ---- the native ggml reference -------------------------------------------------------------


def _ggml_src() -> Path | None:
    for p in sorted((ROOT.parent / "llcpp").glob("*/llama.cpp/ggml")):
        if (p / "src" / "ggml-quants.c").is_file():
            return p
    return None


@pytest.fixture(scope="session")
def ggml_ref(tmp_path_factory):
    """ctypes handle on ggml-quants.c compiled as plain x86-64 (no FMA, like ggml-base)."""
    src, cc = _ggml_src(), shutil.which("cc") or shutil.which("gcc")
    if src is None or cc is None:
        pytest.skip("llama.cpp source tree or C compiler not available")
    out = tmp_path_factory.mktemp("ggml") / "libggmlquants.so"
    cmd = [
        cc,
        "-O2",
        "-std=gnu11",
        "-fPIC",
        "-shared",
        f"-I{src}/include",
        f"-I{src}/src",
        f"-I{src}/src/ggml-cpu",
        str(src / "src" / "ggml-quants.c"),
        "-o",
        str(out),
        "-lm",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot compile ggml-quants.c: {res.stderr[-300:]}")
    return ctypes.CDLL(str(out), mode=getattr(ctypes, "RTLD_LAZY", 1) | ctypes.RTLD_LOCAL)


def ggml_quantize(lib, x: np.ndarray, t) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], row_bytes(t, x.shape[1])), np.uint8)
    fn = getattr(lib, f"quantize_row_{FMT[t]}_ref")
    for r in range(x.shape[0]):
        fn(x[r].ctypes.data_as(ctypes.c_void_p), out[r].ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.shape[1]))
    return out


def ggml_dequantize(lib, raw: np.ndarray, t, n_cols: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw)
    out = np.zeros((raw.shape[0], n_cols), np.float32)
    fn = getattr(lib, f"dequantize_row_{FMT[t]}")
    for r in range(raw.shape[0]):
        fn(raw[r].ctypes.data_as(ctypes.c_void_p), out[r].ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n_cols))
    return out


# ---- ggml_types ----------------------------------------------------------------------------


def test_type_table_matches_ggml_sizes_and_names():
    for qt in gguf.GGMLQuantizationType:
        info = TYPES.get(qt.value) or UNSUPPORTED_TYPES.get(qt.value)
        assert info is not None, qt
        assert T(qt.value).name == qt.name
        assert info.name.upper() == qt.name
        if qt == gguf.GGMLQuantizationType.Q8_1:
            # gguf-py lists 40 (an old f32 d/s layout); ggml's static_assert says 2 halves + 32
            assert (info.block_size, info.type_size) == (32, 36)
        else:
            assert (info.block_size, info.type_size) == gguf.GGML_QUANT_SIZES[qt]
    assert (TYPES[T.Q8_0].type_size, TYPES[T.Q4_0].type_size, TYPES[T.Q4_K].type_size, TYPES[T.Q6_K].type_size) == (
        34,
        18,
        144,
        210,
    )
    assert KV_CACHE_TYPES == ("f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "bf16")
    assert set(TYPES) == set(Q.QUANT_TABLE)  # every supported format has a dequantizer


def test_type_lookup_and_errors():
    assert type_by_name("Q8_0").type_id == 8
    assert type_by_name(" iq4_NL ").type_id == 20
    assert type_by_name("q4_k").type_id == 12 and not type_by_name("q4_k").kv_ok
    with pytest.raises(ValueError, match="valid cache types: f32, f16, q4_0.*bf16"):
        type_by_name("q9_0")
    with pytest.raises(ValueError, match="invalid cache type 'q6_K'"):
        cache_type_by_name("q6_K")
    assert cache_type_by_name("F16").type_id == 1
    with pytest.raises(ValueError, match="iq2_xxs .id 16. is not supported"):
        type_info(16)
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        type_info(99)
    assert type_name(23) == "iq4_xs" and type_name(99) == "type 99"
    assert row_bytes(T.Q8_0, 64) == 68 and row_bytes(T.Q6_K, 512) == 420
    assert row_bytes(T.F16, 7) == 14
    with pytest.raises(ValueError, match="not a multiple of the q4_0 block size 32"):
        row_bytes(T.Q4_0, 48)


# ---- half / bfloat16 -----------------------------------------------------------------------


def test_f16_to_f32_exhaustive():
    bits = np.arange(65536, dtype=np.uint16)
    got = Q.dequantize(bits.view(np.uint8)[None], T.F16, 65536)[0]
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # incl. -0, subnormals, inf
    assert np.isnan(got[nan]).all()


def _f32_edge_values() -> np.ndarray:
    vals = [
        0.0,
        -0.0,
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        1e9,
        np.inf,
        -np.inf,
        2.0**-14,
        2.0**-24,
        2.0**-25,
        2.0**-25 * 1.0000001,
        3 * 2.0**-25,
        2.0**-26,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        6.1e-5,
        1e-45,
    ]
    return np.array(vals + [-v for v in vals], np.float32)


def test_f32_to_f16_matches_numpy_rounding():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, _f32_edge_values()])
    got = Q.quantize(x[None], T.F16).view(np.uint16)[0]
    nan = np.isnan(x)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got[~nan], ref[~nan])
    # NaN -> ggml's canonical quiet NaN with the sign kept
    sign = (x[nan].view(np.uint32) >> 16) & 0x8000
    assert np.array_equal(got[nan], (sign | 0x7E00).astype(np.uint16))


def test_bf16_both_ways():
    rng = np.random.default_rng(4)
    x = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, _f32_edge_values()])[:300_000].reshape(-1, 100)
    x[0, :38] = _f32_edge_values()
    got = Q.quantize(x, T.BF16)
    assert np.array_equal(got, gq.quantize(x, gguf.GGMLQuantizationType.BF16))
    back = Q.dequantize(got, T.BF16, 100)
    ref = gq.dequantize(got, gguf.GGMLQuantizationType.BF16)
    nan = np.isnan(ref)
    assert np.array_equal(back[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(back[nan]).all() and np.isnan(x[nan]).all()


def test_f32_rows_are_byte_copies():
    x = np.concatenate([_f32_edge_values(), np.float32([np.nan, 1.5])]).reshape(1, -1)
    raw = Q.quantize(x, T.F32)
    assert np.array_equal(raw, x.view(np.uint8))
    assert np.array_equal(Q.dequantize(raw, T.F32, x.shape[1]).view(np.uint32), x.view(np.uint32))


# ---- quantizers ----------------------------------------------------------------------------


@pytest.mark.parametrize("t", GQ_QUANTIZES, ids=lambda t: FMT[t])
def test_quantize_identical_to_gguf_py(t):
    for name, x in cases(256).items():
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ref = np.ascontiguousarray(gq.quantize(x, gguf.GGMLQuantizationType(t)))
        ref = ref.view(np.uint8)  # gguf-py returns f16 as float16
        got = Q.quantize(x, t)
        bad = np.nonzero((got != ref).any(axis=1))[0]
        assert bad.size == 0, f"{FMT[t]} {name}: rows {bad.tolist()} differ"


@pytest.mark.parametrize("t", [T.Q8_0, T.Q8_1, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL], ids=lambda t: FMT[t])
def test_quantize_identical_to_ggml_c(ggml_ref, t):
    for name, x in cases(512, seed=5).items():
        if t == T.IQ4_NL and name == "zeros":
            continue  # ggml leaves the indices of an all-zero iq4_nl block uninitialised
        with np.errstate(over="ignore", invalid="ignore"):
            ref = ggml_quantize(ggml_ref, x, t)
        got = Q.quantize(x, t)
        bad = np.nonzero((got != ref).any(axis=1))[0]
        assert bad.size == 0, f"{FMT[t]} {name}: rows {bad.tolist()} differ"


def test_iq4_nl_zero_block_decodes_to_zero():
    x = np.zeros((1, 64), np.float32)
    x[0, 32:] = np.linspace(-1, 1, 32)
    raw = Q.quantize(x, T.IQ4_NL)
    back = Q.dequantize(raw, T.IQ4_NL, 64)
    assert np.all(back[0, :32] == 0.0) and np.abs(back[0, 32:] - x[0, 32:]).max() < 24 / 127


def _roundtrip_bound(t, x: np.ndarray) -> np.ndarray:
    """Per-value error bound for format t, from each 32-block's range (f16 scale rounding
    adds a relative 2^-11 of the block's largest magnitude per stored half)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    rng_ = blocks.max(axis=-1, keepdims=True) - blocks.min(axis=-1, keepdims=True)
    # a stored half has relative error 2^-11, and absolute error 2^-25 in the subnormal range
    qmax = {T.Q8_0: 127, T.Q4_0: 8, T.Q5_0: 16, T.Q4_1: 15, T.Q5_1: 31}.get(t, 127)
    half_eps = 2.0**-10 * (amax + rng_) + (qmax + 1) * 2.0**-25
    if t == T.F32:
        b = np.zeros_like(blocks)
    elif t == T.F16:
        b = np.abs(blocks) * 2.0**-11 + 2.0**-25
    elif t == T.BF16:
        b = np.abs(blocks) * 2.0**-8
    elif t == T.Q8_0:
        b = amax / 127 * 0.5 + half_eps
    elif t == T.Q4_0:
        b = amax / 8 + half_eps  # the side opposite the extreme clamps at +7 (one full step)
    elif t == T.Q5_0:
        b = amax / 16 + half_eps
    elif t == T.Q4_1:
        b = rng_ / 15 * 0.5 + half_eps
    elif t == T.Q5_1:
        b = rng_ / 31 * 0.5 + half_eps
    elif t == T.IQ4_NL:
        b = amax * (24 / 127) + half_eps  # widest table gap 89..113 (+ l.s. rescale)
    return np.broadcast_to(b * 1.0001, blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("t", CACHE_TYPES, ids=lambda t: FMT[t])
def test_round_trip_error_bounds(t):
    for name, x in cases(256, seed=6).items():
        if name == "large" and t not in (T.F32, T.BF16):
            x = x / 4  # keep inside the half range (65504)
        back = Q.dequantize(Q.quantize(x, t), t, x.shape[1])
        err = np.abs(back.astype(np.float64) - x)
        bound = _roundtrip_bound(t, x.astype(np.float64))
        assert np.all(err <= bound), f"{FMT[t]} {name}: max excess {(err - bound).max():.3g}"
    # a constant block decodes exactly when its scale (or min) is a representable half
    exact = {
        T.Q8_0: 127 / 16,
        T.Q4_0: 3.25,
        T.Q4_1: 3.25,
        T.Q5_0: 3.25,
        T.Q5_1: 3.25,
        T.IQ4_NL: -127 / 16,
        T.F16: 3.25,
        T.BF16: 3.25,
        T.F32: 3.3,
    }
    c = np.full((1, 64), exact[t], np.float32)
    assert np.array_equal(Q.dequantize(Q.quantize(c, t), t, 64), c)


# ---- dequantizers --------------------------------------------------------------------------


def _random_blocks(t, n_rows: int, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes with every half-float scale field set to a finite value of sane size."""
    rng = np.random.default_rng(seed)
    info = TYPES[t]
    raw = rng.integers(0, 256, (n_rows, n_blocks, info.type_size), dtype=np.uint8)
    half_fields = {
        T.Q4_0: [0],
        T.Q4_1: [0, 2],
        T.Q5_0: [0],
        T.Q5_1: [0, 2],
        T.Q8_0: [0],
        T.Q8_1: [0, 2],
        T.IQ4_NL: [0],
        T.Q2_K: [80, 82],
        T.Q3_K: [108],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
    }.get(t, [])
    for off in half_fields:
        h = rng.uniform(-0.5, 0.5, (n_rows, n_blocks)).astype(np.float16).view(np.uint16)
        raw[:, :, off] = h & 0xFF
        raw[:, :, off + 1] = h >> 8
    if t == T.Q8_K:
        raw[:, :, 0:4] = rng.uniform(-0.5, 0.5, (n_rows, n_blocks)).astype(np.float32)[..., None].view(np.uint8)
    return raw.reshape(n_rows, -1)


DEQUANT_VS_GGUF = [t for t in TYPES if t not in (T.Q8_1, T.Q8_K)]  # gguf-py has neither


@pytest.mark.parametrize("t", DEQUANT_VS_GGUF, ids=lambda t: FMT[t])
def test_dequantize_random_blocks_vs_gguf_py(t):
    info = TYPES[t]
    n_blocks = 4 if info.block_size > 1 else 1024
    raw = _random_blocks(t, 8, n_blocks, seed=int(t))
    n = n_blocks * info.block_size
    got = Q.dequantize(raw, t, n)
    ref = gq.dequantize(raw, gguf.GGMLQuantizationType(t)).reshape(8, n)
    if t in (T.F16, T.BF16, T.F32):  # random bits include NaN/inf
        fin = np.isfinite(ref)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert np.array_equal(got[fin], ref[fin]) and np.array_equal(got[np.isinf(ref)], ref[np.isinf(ref)])
    else:
        assert ulps(got, ref) <= 1


@pytest.mark.parametrize(
    "t", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K, T.Q8_1, T.IQ4_NL, T.Q4_0, T.Q5_1], ids=lambda t: FMT[t]
)
def test_dequantize_ggml_quantized_vs_ggml_c(ggml_ref, t):
    """Realistic blocks (made by ggml's own reference quantizer where gguf-py has none)."""
    x = cases(512, seed=7)["normal"]
    raw = ggml_quantize(ggml_ref, x, t)
    got = Q.dequantize(raw, t, 512)
    if t == T.Q8_1:  # ggml has no q8_1 decoder: it is q8_0 plus the s field
        as_q8_0 = np.delete(raw.reshape(-1, 16, 36), [2, 3], axis=2).reshape(-1, 16 * 34)
        assert ulps(got, ggml_dequantize(ggml_ref, as_q8_0, T.Q8_0, 512)) <= 1
    else:
        assert ulps(got, ggml_dequantize(ggml_ref, raw, t, 512)) <= 1
    if t not in (T.Q8_1, T.Q8_K):
        assert ulps(got, gq.dequantize(raw, gguf.GGMLQuantizationType(t))) <= 1
    rel = np.abs(got - x).max() / np.abs(x).max()
    assert rel < {T.Q2_K: 0.6, T.Q3_K: 0.3}.get(t, 0.15)  # it decodes to the data, not noise


# ---- dispatch ------------------------------------------------------------------------------


@njit(cache=True)
def _njit_round_trip(x, t, buf, out):
    """A kernel using the runtime dispatch, as the KV cache / attention code does."""
    ok_q = Q.quant_row_any(t, x, buf)
    ok_d = Q.dequant_row_any(t, buf, out)
    return ok_q and ok_d


def test_runtime_dispatch_inside_njit():
    x = np.linspace(-2, 2, 64).astype(np.float32)
    for t in CACHE_TYPES:
        buf = np.zeros(row_bytes(t, 64), np.uint8)
        out = np.zeros(64, np.float32)
        assert _njit_round_trip(x, np.int64(t), buf, out)
        assert np.array_equal(buf, Q.quantize(x[None], t)[0])
        assert np.array_equal(out, Q.dequantize(buf[None], t, 64)[0])
    assert not _njit_round_trip(x, np.int64(T.Q4_K), np.zeros(36, np.uint8), out)
    assert not Q.dequant_row_any(np.int64(16), np.zeros(66, np.uint8), np.zeros(256, np.float32))


def test_row_functions_match_whole_matrix_calls():
    x = cases(128, seed=8)["normal"][:3]
    for t in CACHE_TYPES:
        fq = Q.QUANT_TABLE[t].quant_row
        fd = Q.QUANT_TABLE[t].dequant_row
        assert fq is getattr(Q, f"quant_row_{FMT[t]}") and fd is getattr(Q, f"dequant_row_{FMT[t]}")
        raw = Q.quantize(x, t)
        row = np.zeros(raw.shape[1], np.uint8)
        fq(x[1], row)
        assert np.array_equal(row, raw[1])
        back = np.zeros(128, np.float32)
        fd(raw[2], back)
        assert np.array_equal(back, Q.dequantize(raw, t, 128)[2])


def test_wrapper_errors_and_readonly_input():
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="cannot quantize to q4_K"):
        Q.quantize(x, T.Q4_K)
    with pytest.raises(ValueError, match="not a multiple of the q8_0 block size"):
        Q.quantize(np.ones((2, 48), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="need 68 bytes"):
        Q.dequantize(np.zeros((2, 70), np.uint8), T.Q8_0, 64)
    with pytest.raises(ValueError, match="iq2_xxs"):
        Q.dequantize(np.zeros((1, 66), np.uint8), 16, 256)
    x = np.full((2, 64), 127 / 16, np.float32)  # scale 1/16 is exact in f16
    raw = Q.quantize(x, T.Q8_0)
    raw.setflags(write=False)  # model tensors are read-only mmap views
    assert np.array_equal(Q.dequantize(raw, T.Q8_0, 64), x)
    assert Q.dequantize(np.zeros((0, 34), np.uint8), T.Q8_0, 32).shape == (0, 32)


# ---- real model tensors --------------------------------------------------------------------


def _check_model_tensors(path: Path, expected: set[str]):
    reader = gguf.GGUFReader(path)
    seen: dict[str, int] = {}
    for ten in reader.tensors:
        name = ten.tensor_type.name
        if seen.get(name, 0) >= 2:  # two tensors per type is enough
            continue
        seen[name] = seen.get(name, 0) + 1
        t = int(ten.tensor_type)
        n_cols = int(ten.shape[0])
        data = np.asarray(ten.data)
        raw = data.view(np.uint8).reshape(-1, row_bytes(t, n_cols))
        mid = raw.shape[0] // 2
        rows = np.concatenate([raw[:4], raw[mid : mid + 4], raw[-2:]])
        got = Q.dequantize(rows, t, n_cols)
        ref = gq.dequantize(rows, ten.tensor_type).reshape(rows.shape[0], n_cols)
        assert ulps(got, ref) <= 1, f"{path.name} {ten.name} ({name})"
        assert np.isfinite(got).all()
        # quantizing real values to each cache type gives gguf-py's bytes
        for ct in (T.Q8_0, T.Q4_0, T.Q5_1):
            assert np.array_equal(Q.quantize(got[:4], ct), gq.quantize(got[:4], gguf.GGMLQuantizationType(ct)))
    assert expected <= set(seen), f"{path.name}: types found {sorted(seen)}"


@pytest.mark.real_model
def test_smollm2_tensors(smollm2_path):
    _check_model_tensors(smollm2_path, {"Q4_1", "Q8_0", "F32"})


@pytest.mark.real_model
def test_gemma3_tensors(gemma3_path):
    _check_model_tensors(gemma3_path, {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"})


# ---- mxfp4 (weights only) --------------------------------------------------------------------


def test_mxfp4_dequantizes_gguf_py_blocks_exactly():
    """gpt-oss's expert format: gguf-py's quantizer's blocks decode to gguf-py's values bit for bit, and
    every decoded value is a table integer / 2 times 2^(e - 127), computed in float64."""
    x = cases(512, seed=11)["normal"] * np.float32(3.0)
    raw = gq.quantize(x.reshape(-1, 512), gguf.GGMLQuantizationType.MXFP4)
    got = Q.dequantize(raw, T.MXFP4, 512)
    np.testing.assert_array_equal(got, gq.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(got.shape))
    blk = raw.reshape(-1, 17)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    vals = e2m1[np.concatenate([blk[:, 1:] & 15, blk[:, 1:] >> 4], 1)]  # [n_blocks, 32]
    want = vals * np.exp2(blk[:, :1].astype(np.float64) - 127)
    np.testing.assert_array_equal(got.reshape(-1, 32).astype(np.float64), want)
    assert np.abs(got - x).max() / np.abs(x).max() < 0.2  # it decodes to the data


def test_mxfp4_extreme_exponents_decode_as_ggml_builds_them():
    """e = 0 and 1 are ggml's denormal bit patterns (2^-128, 2^-127 for a table 1); at e = 254 a table 1 is
    2^126 and a table 12 overflows to inf, as ggml's float product does."""
    raw = np.zeros((3, 17), np.uint8)
    raw[:, 0] = (0, 1, 254)
    raw[:, 1] = 0x71  # values 0 and 16: table 1 and 12
    got = Q.dequantize(raw.reshape(3, 17), T.MXFP4, 32)
    assert got[0, 0] == np.float32(2.0**-128) and got[1, 0] == np.float32(2.0**-127)
    assert got[2, 0] == np.float32(2.0**126) and got[2, 16] == np.inf
