"""Feed-forward activations and the row softmax.

- SwiGLU: silu(gate) * up, silu(x) = x / (1 + e^-x)        (llama, qwen2, qwen3: LLM_FFN_SILU, PAR)
  with ggml's vectorized exp in the form llama.cpp runs on this CPU (AVX2 or AVX-512: they round
  differently; kernels/ggml_math.py), so the values are llama.cpp's bits (a width that is not a
  multiple of ggml's vector, 8 or 16, is not mirrored in its last values: ggml's scalar tail uses
  libm's expf there)
- GeGLU:  gelu(gate) * up with ggml's tanh approximation  (gemma2, gemma3: LLM_FFN_GELU, PAR)
  gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))), read as ggml's CPU build reads it:
  from its f16 table, 0 / x beyond |x| >= 10 (kernels/gelu_table.py), so the values are
  llama.cpp's bits too
- softmax over rows with -inf masking (classic attention path, tests).

Everything here is element-wise, so it is compiled without fast-math: with reassoc/arcp/contract
LLVM rewrote x / (1 + e^-x) * u differently in the serial and the parallel twin (a third of the
values differed in the last bit), and a row's result must not depend on how many rows there are
(batch invariance, see kernels/attention.py). Without vectorizable math functions (no SVML) the
flags bought no speed. Both activations are branch-free (selects), so their loops vectorize.
"""

import math

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.gelu_table import geglu_row, gelu_table
from kvchat.kernels.ggml_math import silu_ggml

_NO_TABLE = np.zeros(1, dtype=np.float32)  # the table argument of the SiLU loops (never read)


@njit(cache=True, inline="always")
def silu_f32(x):
    """x * sigmoid(x) of one f32 value, bit for bit as ggml's x86 build on this CPU (ggml_v_silu
    with its own exp: kernels/ggml_math.py)."""
    return silu_ggml(x)


@njit(cache=True, inline="always", error_model="numpy")
def _glu_row(gu, n_ff, use_gelu, table, out):
    """One row: a loop per activation, branch-free, so the arithmetic vectorizes."""
    if use_gelu:
        geglu_row(gu[:n_ff], gu[n_ff : 2 * n_ff], table, out)
    else:
        for i in range(n_ff):
            out[i] = silu_f32(gu[i]) * gu[n_ff + i]


@njit(cache=True, parallel=True, error_model="numpy")
def _glu_rows_par(gu, n_ff, use_gelu, table, out):
    """gu: [n, 2*n_ff] f32 = [gate | up] per row; table: [65536] f32 GELU table; out: [n, n_ff] f32."""
    for r in prange(gu.shape[0]):
        _glu_row(gu[r], n_ff, use_gelu, table, out[r])


@njit(cache=True, error_model="numpy")
def _glu_rows_ser(gu, n_ff, use_gelu, table, out):
    for r in range(gu.shape[0]):
        _glu_row(gu[r], n_ff, use_gelu, table, out[r])


@njit(cache=True, inline="always", error_model="numpy")
def _glu_split_row(gate, up, use_gelu, table, out):
    if use_gelu:
        geglu_row(gate, up, table, out)
    else:
        for i in range(gate.shape[0]):
            out[i] = silu_f32(gate[i]) * up[i]


@njit(cache=True, parallel=True, error_model="numpy")
def _glu_split(gate, up, use_gelu, table, out):
    """gate, up, out: [n, n_ff] f32."""
    for r in prange(gate.shape[0]):
        _glu_split_row(gate[r], up[r], use_gelu, table, out[r])


def swiglu(gate, up):
    """silu(gate) * up. gate, up: [n, n_ff] f32 -> [n, n_ff] f32."""
    out = np.empty_like(gate)
    _glu_split(gate, up, False, _NO_TABLE, out)
    return out


def geglu(gate, up):
    """gelu(gate) * up. gate, up: [n, n_ff] f32 -> [n, n_ff] f32."""
    out = np.empty_like(gate)
    _glu_split(gate, up, True, gelu_table(), out)
    return out


def glu_fused(gate_up, n_ff, use_gelu, rows_per_token: int = 1):
    """The same on one [n, 2*n_ff] f32 array holding gate then up (a fused gate+up matmul).
    rows_per_token: rows a token has (a MoE layer's k experts): the parallel threshold counts
    tokens, so that a decoded token's k short rows stay on this thread."""
    out = np.empty((gate_up.shape[0], n_ff), dtype=np.float32)
    fn = _glu_rows_par if gate_up.shape[0] >= parallel.GLU_PAR_MIN_ROWS * rows_per_token else _glu_rows_ser
    fn(gate_up, n_ff, use_gelu, gelu_table() if use_gelu else _NO_TABLE, out)
    return out


@njit(cache=True, fastmath=False, inline="always")
def softmax_inplace(x, n):
    """Softmax of x[:n] in place (f32). -inf entries become 0; an all -inf row becomes all 0."""
    m = -np.inf
    for j in range(n):
        if x[j] > m:
            m = x[j]
    if m == -np.inf:
        for j in range(n):
            x[j] = 0.0
        return
    s = 0.0
    for j in range(n):
        e = np.float32(math.exp(x[j] - m)) if x[j] != -np.inf else np.float32(0.0)
        x[j] = e
        s += e
    inv = np.float32(1.0 / s)
    for j in range(n):
        x[j] *= inv


@njit(cache=True, parallel=True)
def _softmax_rows(x):
    for r in prange(x.shape[0]):
        softmax_inplace(x[r], x.shape[1])


def softmax(x):
    """Row softmax of x ([n, m] f32) in place; returns x."""
    _softmax_rows(x)
    return x
