"""GeGLU as ggml's CPU backend computes it (kernels/gelu_table.py): the GELU table against
llama.cpp's own table and against ggml_gelu_f32's expression, and the branch-free f16 lookup
against the plain one (numpy's round-to-nearest-even half conversion) bit for bit."""

import ctypes
import ctypes.util
import os
from pathlib import Path

import numpy as np
import pytest

from kvchat.kernels.act import geglu, glu_fused
from kvchat.kernels.gelu_table import gelu_table

_HALVES = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)  # [65536] every half
_READ = np.abs(_HALVES) < 10  # the entries ggml reads (|x| >= 10 and NaN saturate first)


def _ggml_reference(gate, up):
    """ggml_vec_geglu_f32 with GGML_GELU_FP16, in numpy: 0 for x <= -10, x * up for x >= 10,
    table[f16(x)] * up between (NaN takes the table path and stays NaN)."""
    with np.errstate(invalid="ignore", over="ignore"):
        t = gelu_table()[gate.astype(np.float16).view(np.uint16)]
        return np.where(gate <= -10, np.float32(0.0), np.where(gate >= 10, gate * up, t * up)).astype(np.float32)


def _libggml_cpu():
    """llama.cpp's libggml-cpu.so: KVCHAT_LLAMA_LIB, else a build under /work/llamacpp that this CPU runs."""
    folders = [Path(os.environ["KVCHAT_LLAMA_LIB"])] if os.environ.get("KVCHAT_LLAMA_LIB") else []
    root = Path("/work/llamacpp")
    if root.is_dir():
        folders += sorted(p.parent for p in root.rglob("libggml-cpu.so") if "noamx" in str(p))
    for d in folders:
        if (d / "libggml-cpu.so").is_file() and (d / "libggml-base.so").is_file():
            return d
    return None


@pytest.mark.skipif(_libggml_cpu() is None, reason="no llama.cpp build (libggml-cpu.so) found")
def test_gelu_table_is_llama_cpps_own_on_every_entry_it_reads():
    """ggml_table_gelu_f16 as ggml_cpu_init fills it, read from llama.cpp's library."""
    d = _libggml_cpu()
    ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_cpu_init()
    theirs = np.frombuffer((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16"), dtype=np.uint16)
    ours = gelu_table().astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(ours[_READ], theirs[_READ])


def test_gelu_table_is_ggml_gelu_f32_with_gccs_fma_and_libm_tanhf():
    """f16(0.5 x (1 + tanhf(sqrt(2/pi) x fma(0.044715 x, x, 1)))) in f32 on every read half;
    without the fma (a * x * x + 1 rounded twice) one entry differs, x = -1.999."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    f = np.float32
    s, a = f(0.79788456080286535587989211986876), f(0.044715)
    x = _HALVES[_READ]

    def gelu(fused):
        inner = np.empty_like(x)
        for i, xi in enumerate(x):
            p = f(np.float64(a * xi) * np.float64(xi) + 1.0) if fused else f(a * xi * xi) + f(1)
            inner[i] = libm.tanhf(float(s * xi * p))
        return (f(0.5) * x * (f(1) + inner)).astype(np.float16)

    np.testing.assert_array_equal(gelu_table()[_READ].astype(np.float16), gelu(True))
    unfused = gelu(False) != gelu_table()[_READ].astype(np.float16)
    np.testing.assert_array_equal(x[unfused], np.float32([-1.9990234]))


def test_geglu_gives_ggmls_bits_on_a_stride_of_all_float32_patterns():
    """Every 4099th bit pattern (normals, subnormals, ±0, NaNs, ±inf), the half-rounding ties
    and the subnormal/normal half boundary densely, both saturation edges; odd widths run the
    vector loop's remainder. (All 2^32 gate values were checked once: docs/performance.md.)"""
    pats = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    h = _HALVES[_READ].astype(np.float16)
    ties = h.astype(np.float32) + np.abs(np.spacing(h)).astype(np.float32) / 2  # halfway to the next half
    sub = np.linspace(-(2**-13), 2**-13, 40001, dtype=np.float32)
    edges = np.concatenate([np.nextafter(np.float32(v), np.float32([-np.inf, np.inf])) for v in (-10, 10)])
    g = np.concatenate([pats, ties, sub, edges, np.float32([-10, 10, 0.0, -0.0, np.inf, -np.inf])])
    u = np.random.default_rng(3).standard_normal(g.size).astype(np.float32)
    for width in (g.size, 13):
        x, y = g[None, :width], u[None, :width]
        want = _ggml_reference(x, y)
        np.testing.assert_array_equal(geglu(x, y), want)
        np.testing.assert_array_equal(glu_fused(np.concatenate([x, y], axis=1), width, True), want)


def test_geglu_saturates_to_a_positive_zero_and_to_x_times_up():
    """x <= -10 gives +0.0 whatever up is (ggml writes 0.0f; 0 * up would be -0 or NaN)."""
    g = np.float32([[-12.0, -10.0, -10.0, 10.0, 11.0]])
    u = np.float32([[-1.0, np.inf, -3.0, 2.0, -1.0]])
    got = geglu(g, u)
    np.testing.assert_array_equal(got, [[0.0, 0.0, 0.0, 20.0, -11.0]])
    assert not np.signbit(got[0, :3]).any()


def test_geglu_is_the_table_value_times_up():
    """Inside (-10, 10): table[f16(x)] * up, one f32 product; the table holds f16 values."""
    x = np.linspace(-9.99, 9.99, 5001, dtype=np.float32)[None]
    u = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    t = gelu_table()[x.astype(np.float16).view(np.uint16)]
    np.testing.assert_array_equal(t, t.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(geglu(x, u), t * u)
    xh = x.astype(np.float16).astype(np.float64)  # the tanh form at the half-rounded x, to half precision
    exact = 0.5 * xh * (1 + np.tanh(np.sqrt(2 / np.pi) * xh * (1 + 0.044715 * xh**2)))
    np.testing.assert_allclose(geglu(x, np.ones_like(x)), exact, rtol=1e-3, atol=2.5e-7)
