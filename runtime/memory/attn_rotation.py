"""Attention rotation of quantized KV caches (llama.cpp's n_rot_k / n_rot_v).

When a cache type is quantized, llama.cpp multiplies Q and K (and V, undone on the attention
output) chunk-wise by an orthonormal Hadamard matrix before K/V are stored. The rotation spreads
outlier channels across a whole block, so one block scale fits all its values and the
quantization error shrinks (SmolLM2 q4_0 perplexity: +15% without it). Scores are unchanged
because Q and K are rotated alike and H is orthonormal.

The cache owns the sizes (it knows its types; they are part of its saved state); the forward
pass asks the memory context for them; the K-shift un-rotates, applies RoPE, re-rotates.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.hadamard import fwht_chunks

_FLOAT_TYPES = (int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16))
_HADAMARD: dict[int, np.ndarray] = {}


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix [n, n] f32 (n a power of two); symmetric, H·H = I."""
    h = _HADAMARD.get(n)
    if h is None:
        if n <= 0 or n & (n - 1):
            raise ValueError(f"Hadamard size must be a power of two, got {n}")
        h = np.ones((1, 1))
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        h = (h / np.sqrt(n)).astype(np.float32)
        _HADAMARD[n] = h
    return h


def rotation_sizes(hp, type_k: int, type_v: int) -> tuple[int, int]:
    """(n_rot_k, n_rot_v) as llama-kv-cache.cpp chooses them; 0 = no rotation (float caches).
    K: the largest power-of-two chunk (from 64 up) dividing the head size; V: 64."""
    rk = rv = 0
    if int(type_k) not in _FLOAT_TYPES and hp.n_embd_head_k % 64 == 0:
        rk = 64
        while hp.n_embd_head_k % (2 * rk) == 0:
            rk *= 2
    if int(type_v) not in _FLOAT_TYPES and hp.n_embd_head_v % 64 == 0:
        rv = 64
    return rk, rv


def rotate(x: np.ndarray, n: int) -> np.ndarray:
    """x [..., d] f32 with d % n == 0 -> each n-chunk times hadamard(n) (a new array), by the
    fast transform of kernels/hadamard.py: bit-identical per row whatever the batch.
    Self-inverse: rotate(rotate(x, n), n) == x up to rounding."""
    return fwht_chunks(x, n)
