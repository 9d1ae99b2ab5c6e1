"""y = x · Wᵀ for a quantized weight matrix W (``QMatrix``), for generation and for prefill.

Weights stay quantized. At load time each matrix is repacked once (kernels/repack.py) into a
row-interleaved layout — 32 rows side by side, scales separated from the 4- or 8-bit values —
so that the SIMD lanes run over output rows (kernels/matmul_kernels.py).

**Batch invariance.** Every n (1 for generation, up to n_ubatch for prefill) runs the same
kernel, ``matmul_blocks``, and each output element y[t, r] is computed by the same explicit
vector operations in the same order whatever n is, whatever the other rows of x are and
whatever the thread count: ``W.matmul(x)[t]`` is bit-identical to ``W.matmul(x[t:t+1])[0]``
(tests/test_matmul.py asserts it with array_equal for every layout). Before, n < 8 ran numba
gemv kernels and n >= 8 decoded panels for a BLAS sgemm; the two rounded differently in the
last bit, and with an f16 KV cache that made token-by-token decoding of SmolLM2 differ from
one-batch decoding by up to 3e-2 in the logits. BLAS is not used for weights any more: its
summation order depends on n.

Measured choices (this machine shared with other busy sessions, so ±30 %; one thread,
process time; GMAC/s = m·k·n / time; benchmarks/bench_matmul.py --threads 1, and the old
kernels run on the same packed arrays in the same session for the comparisons):
- explicit <16 x float> vectors (kernels/simd.py) instead of loops left to LLVM's vectorizer:
  the vectorizer only handles innermost loops, so a register-blocked multi-token loop came out
  scalar (2 GMAC/s), and with fastmath it may reassociate sums differently per loop nest.
- prefill: a block is decoded once per 32-token chunk into a 4 KB scratch and four tokens at a
  time go through it with 16 accumulators in zmm registers (16 FMAs per 4 vector loads; six
  tokens measured the same). SmolLM2 q4_1 40 GMAC/s (decode + sgemm before: 43), q8_0 46 (28);
  Gemma-3 q4_K 39 (33), q5_0 42 (31), q8_0 41 (32), q6_K 32 (40: its 16-value blocks double
  the per-block work of applying scales); best runs 57-61 GMAC/s, against 83 for a pure
  register FMA loop. Under load the numba pool also degrades far less than OpenBLAS's spinning
  threads did (SmolLM2 prefill matmuls 1.4-1.6 s vs 4 s per 512 tokens at load average 4).
  Tried without gain: a block-major copy of x per call (tokens contiguous per block; 0-18 %
  slower), dynamic scheduling of the runs (numba.set_parallel_chunksize; same times).
- generation (fewer than 4 tokens in a chunk): the block is decoded in registers, no scratch;
  two partial sums per half of the rows keep 4 FMA chains in flight. 17.6-19.5 GMAC/s in
  cache for q4_1 / q8_0 / q4_K / q6_K (old gemv in the same session: 10.4-14.7). It is bound by
  the decode uops (widen + convert per 16 values); widening the nibble bytes to i32 before
  masking measured the same.
- work split: (32-row group, 32-token chunk) items, cut into RUNS_PER_THREAD runs of consecutive
  items per possible thread; each run allocates its scratch once (per-item allocation and
  call overhead cost ~40 % on the small generation matrices) and keeps a row group's weights
  in cache across its token chunks (interleaved items re-streamed Gemma's 167 MB output matrix
  once per chunk). The parallel kernel only splits items and calls a serial function: numba's
  parfor passes over the whole body took 7 of 9.5 s of compiling one specialization (now
  4-6 s per layout and scale dtype on a cold cache; SmolLM2's cold first token 35.7 s against
  39.3 s with the old gemv + decode kernels, same session).
- token chunk 32 vs 64 / 128 / 256 (one thread, min of 12 alternating runs, three sessions):
  32 is the fastest or within noise everywhere, clearly for k = 1536 / 2048 (q4_1 576x1536
  31-34 vs 28-32 GMAC/s at 64, q6_K 640x2048 30-47 vs 29-43, 22-31 at 256).
"""
from __future__ import annotations

import numba
import numpy as np

from kernels.ggml_types import GGMLType, row_bytes
from kernels.matmul_kernels import matmul_blocks
from kernels.quants import dequantize
from kernels.repack import padded_k, repack

TOKEN_CHUNK = 32  # tokens per work item: a decoded block is reused by up to this many tokens
RUNS_PER_THREAD = 4  # prange iterations per (possible) thread, each a run of consecutive work items


class QMatrix:
    """A weight matrix of m rows by k values in ggml type t, kept quantized.

    raw: u8 [m, row_bytes] (a read-only view on the model's mmap is fine; it is only read
    again by get_rows). Attributes: m, k, t, kind (packed layout), nbytes (bytes in the
    file), packed_nbytes.
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
        self._k_packed = padded_k(self.t, self.k)  # float rows are padded to whole 32-blocks
        self.kind, self._packed = repack(raw, t, k)
        self.packed_nbytes = int(sum(a.nbytes for a in self._packed))

    def __repr__(self) -> str:
        return f"QMatrix({GGMLType(self.t).name}, m={self.m}, k={self.k})"

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x f32 [n, k] -> f32 [n, m] = x @ W.T (a 1-D x [k] gives [m]). Row t of the result
        depends on row t of x only, bit for bit (module docstring)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            return self.matmul(x[None, :])[0]
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"QMatrix.matmul: x has {x.shape[-1]} columns, matrix has k={self.k}")
        n = x.shape[0]
        if self._k_packed != self.k:
            xp = np.zeros((n, self._k_packed), np.float32)  # [n, kp], zero columns times zero weights
            xp[:, : self.k] = x
            x = xp
        y = np.empty((n, self.m), np.float32)  # [n, m]
        if n:
            matmul_blocks(*self._packed, x, y, TOKEN_CHUNK, RUNS_PER_THREAD * numba.config.NUMBA_NUM_THREADS)
        return y

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids i32 [n] -> f32 [n, k]: those rows dequantized exactly (embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.m):
            raise IndexError(f"QMatrix.get_rows: id out of range 0..{self.m - 1}")
        return dequantize(np.ascontiguousarray(self.raw[ids]), self.t, self.k)
