"""y = x · Wᵀ for a quantized weight matrix W (``QMatrix``), for generation and for prefill.

Weights stay quantized. At load time each matrix is repacked once (kernels/repack.py) into a
row-interleaved layout — 32 rows side by side, scales separated from the 4- or 8-bit values —
so that the SIMD lanes run over output rows (kernels/matmul_kernels.py).

- few tokens (n < GEMM_MIN_TOKENS, i.e. generation): one parallel numba launch that decodes
  each block in registers and multiplies in float (``gemv_*``).
- prefill (n >= GEMM_MIN_TOKENS): panels of rows are decoded to float once per call and shared
  by all n tokens through one BLAS sgemm; a panel is at most PANEL_BYTES, never the matrix.

Measured choices (single thread, process time, this machine shared with ~6 busy processes, so
±30 %; GFLOP/s = 2·m·k per token):
- q4_1 1536x576, n=1: lanes over k with a float dot per 32-block 1.7-2.7 GFLOP/s; the same with
  activations quantized to int8 per block and an int32 dot per block (llama.cpp's q8_1 scheme)
  2.3-3.5 GFLOP/s; lanes over R interleaved rows, float FMA, decode in registers (this module)
  12-18 GFLOP/s (R=16: 6.5, R=64: 10). numba cannot emit the VNNI/maddubs instructions that make
  llama.cpp's integer dot fast, and the per-block horizontal sums of the lanes-over-k layout
  dominate, so the float rows-interleaved kernel is kept.
- q8_0 (i8 layout) n=1: 19-21 GFLOP/s in cache, 12.5 GFLOP/s streaming the 49152x576 output
  matrix (7.8 GB/s); the integer lanes-over-k variant ~3.5 GFLOP/s.
- whole SmolLM2 token (210 q4_1 + output q8_0): 22 ms cpu single thread under contention;
  prefill 512 tokens: 4.3-5.2 s wall (26-32 GFLOP/s, sgemm). benchmarks/bench_matmul.py.
- where the gemv time goes (q8_0, k = 640, one thread): 10-14 GMAC/s while the packed matrix
  sits in L2, 5-7 GMAC/s streaming a 40-170 MB matrix (6-7.5 GB/s). Big matrices (Gemma's
  262144-row output, q5_0 weights) are bound by memory, so f16 scales and no offset stream for
  the symmetric formats (repack.py) cut their time with their bytes (Gemma q8_0 output
  25.7-28.2 -> 24.0-25.0 ms); SmolLM2's small q4_1 matrices are bound by the decode + FMA
  work and did not move. Tried without gain (within the ±15 % noise): four accumulators per
  row to break the FMA chain (LLVM then keeps them in memory and uses ymm), 1-D x slices per
  block (drops the index wrap-around code), prange over chunks of 16 groups (one scratch
  allocation per chunk), widening the nibble byte to i16/i32 before masking (1.5x slower).
- vector width: the i8 inner loop already runs on zmm (vpmovsxbd + vcvtdq2ps + vfmadd over
  2 x 16 lanes); the nib loop gets ymm only, because LLVM's tuning for this CPU prefers 256-bit
  vectors. With ``NUMBA_CPU_FEATURES="<host features>,-prefer-256-bit"`` (process-wide, must be
  set before numba starts, e.g. in kernels/__init__.py) the nib loop runs on zmm: 14 -> 18
  GMAC/s in cache, i8 unchanged.
"""
from __future__ import annotations

import numpy as np

from kernels.ggml_types import GGMLType, row_bytes
from kernels.quants import dequantize
from kernels.matmul_kernels import decode_f32, decode_i8, decode_nib, gemv_f32, gemv_i8, gemv_nib
from kernels.repack import R, repack

GEMM_MIN_TOKENS = 8  # from this many tokens on, decode panels + sgemm beat the gemv kernels
PANEL_BYTES = 8 << 20  # f32 bytes of one decoded panel (fits the L2+L3 share of a core)

_GEMV = {"nib": gemv_nib, "i8": gemv_i8, "f32": gemv_f32}
_DECODE = {"nib": decode_nib, "i8": decode_i8, "f32": decode_f32}


class QMatrix:
    """A weight matrix of m rows by k values in ggml type t, kept quantized.

    raw: u8 [m, row_bytes] (a read-only view on the model's mmap is fine; it is only read
    again by get_rows). Attributes: m, k, t, nbytes (bytes in the file), packed_nbytes.
    """

    def __init__(self, raw: np.ndarray, t: int, k: int):
        if raw.ndim != 2 or raw.dtype != np.uint8:
            raise ValueError(f"QMatrix: raw must be uint8 [m, row_bytes], got {raw.dtype} {raw.shape}")
        rb = row_bytes(t, k)
        if raw.shape[1] != rb:
            raise ValueError(f"QMatrix: rows of {raw.shape[1]} bytes, type {GGMLType(t).name} x {k} needs {rb}")
        self.raw = raw
        self.t = int(t)
        self.k = int(k)
        self.m = int(raw.shape[0])
        self.nbytes = int(raw.nbytes)
        self.kind, self._packed = repack(raw, t, k)
        self.packed_nbytes = int(sum(a.nbytes for a in self._packed))

    def __repr__(self) -> str:
        return f"QMatrix({GGMLType(self.t).name}, m={self.m}, k={self.k})"

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x f32 [n, k] -> f32 [n, m] = x @ W.T (a 1-D x [k] gives [m])."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            return self.matmul(x[None, :])[0]
        if x.shape[1] != self.k:
            raise ValueError(f"QMatrix.matmul: x has {x.shape[1]} columns, matrix has k={self.k}")
        n = x.shape[0]
        y = np.empty((n, self.m), np.float32)  # [n, m]
        if n < GEMM_MIN_TOKENS:
            _GEMV[self.kind](*self._packed, x, y)
            return y
        decode = _DECODE[self.kind]
        n_groups = -(-self.m // R)
        step = max(1, PANEL_BYTES // (4 * self.k * R))  # row groups per panel
        for g0 in range(0, n_groups, step):
            ng = min(step, n_groups - g0)
            p = np.empty((self.k, ng * R), np.float32)  # [k, cols] decoded rows, transposed
            decode(*self._packed, g0, p)
            c0, c1 = g0 * R, min(self.m, (g0 + ng) * R)
            y[:, c0:c1] = (x @ p)[:, : c1 - c0]
        return y

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids i32 [n] -> f32 [n, k]: those rows dequantized exactly (embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.m):
            raise IndexError(f"QMatrix.get_rows: id out of range 0..{self.m - 1}")
        return dequantize(np.ascontiguousarray(self.raw[ids]), self.t, self.k)
