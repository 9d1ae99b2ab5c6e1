"""Fast Walsh-Hadamard transform of fixed-size chunks (the attention rotation of quantized caches).

``fwht_chunks(x, n)`` multiplies every n-value chunk of every row of x by the orthonormal
Sylvester-Hadamard matrix H_n (symmetric, H·H = I) with log2(n) butterfly stages and one final
scale. Why not ``x @ H``: a BLAS product rounds a row differently depending on how many rows
come with it, and the rotated K/V are then rounded to the cache type, so one-token and batched
decoding would store different bits (see docs/performance.md, "Batch splits"). Here each chunk
is transformed by the same operations in the same order, whatever the other rows: bit-identical
per row. It is also O(n log n) instead of O(n²).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _fwht_rows(x, n, scale):
    """x f32 [rows, d] in place, d % n == 0: each n-chunk <- H_n · chunk (unnormalized) * scale.
    No fastmath: the butterflies must stay in the written order."""
    rows, d = x.shape
    for r in range(rows):
        for c0 in range(0, d, n):
            h = 1
            while h < n:
                for i in range(c0, c0 + n, 2 * h):
                    for j in range(i, i + h):
                        a = x[r, j]
                        b = x[r, j + h]
                        x[r, j] = a + b
                        x[r, j + h] = a - b
                h *= 2
            for j in range(c0, c0 + n):
                x[r, j] *= scale


def fwht_chunks(x: np.ndarray, n: int) -> np.ndarray:
    """x [..., d] (d % n == 0, n a power of two) -> a new f32 array, each n-chunk times H_n."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    shape = x.shape
    if shape[-1] % n:
        raise ValueError(f"rows of {shape[-1]} values do not split into chunks of {n}")
    y = np.array(x, dtype=np.float32, order="C").reshape(-1, shape[-1])  # [rows, d] copy
    _fwht_rows(y, n, np.float32(1.0 / np.sqrt(n)))
    return y.reshape(shape)
