"""GELU through ggml's f16 table (GGML_GELU_FP16 in ggml-cpu/vec.h), for GeGLU.

ggml's CPU GELU on f32 does not evaluate the tanh formula per value: for -10 < x < 10 it rounds
x to f16 and reads a 65536-entry table of f16(gelu(x)), so y = f16(gelu(f16(x))); x <= -10
gives 0 and x >= 10 gives x. Where a model's numbers depend on that rounding (Gemma 2's
logits move by ~1e-2 between the two), this reproduces it. Element-wise, so a row's result
does not depend on the batch.
"""
import numpy as np
from numba import njit

from kernels.act import gelu_f32
from kernels.quants_fp import f16_to_f32, f32_to_f16


@njit(cache=True)
def _build_table(out):
    """out [65536] f32 <- f16 value of gelu(half i), as ggml_init fills ggml_table_gelu_f16."""
    for i in range(65536):
        out[i] = f16_to_f32(f32_to_f16(gelu_f32(f16_to_f32(np.uint16(i)))))


_TABLE = np.empty(65536, dtype=np.float32)  # [65536] f32, filled on first use
_READY = [False]


def gelu_table() -> np.ndarray:
    if not _READY[0]:
        _build_table(_TABLE)
        _READY[0] = True
    return _TABLE


def geglu_f16_table(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(gate) * up with ggml's table GELU. gate, up: [n, n_ff] f32 (views fine) -> [n, n_ff] f32."""
    g = np.asarray(gate, dtype=np.float32)
    a = gelu_table()[g.astype(np.float16).view(np.uint16)]  # [n, n_ff] f32, round-to-nearest-even
    a = np.where(g <= np.float32(-10.0), np.float32(0.0), np.where(g >= np.float32(10.0), g, a))
    return (a * np.asarray(up, dtype=np.float32)).astype(np.float32, copy=False)
