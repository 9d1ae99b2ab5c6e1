"""The self-draft's q4_0 rounding (kernels/quants_weighted.py): q4_0 blocks any q4_0 kernel reads,
with a smaller importance-weighted error than ggml's max-abs rounding."""

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.quants import dequantize, quantize
from kvchat.kernels.quants_weighted import quantize_q4_0_weighted

Q4_0 = int(GGMLType.Q4_0)


def weighted_error(x, q, importance):
    """sum over rows of sum_j importance_j * sqrt(sigma2 + x_j^2) * (x_j - x'_j)^2 (the rounding's objective)."""
    err = x - dequantize(q, Q4_0, x.shape[1])
    sigma2 = (x * x).mean(axis=1, keepdims=True)
    return float((importance[None, :] * np.sqrt(sigma2 + x * x) * err * err).sum())


def test_weighted_q4_0_has_less_weighted_error_than_max_abs_rounding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    for importance in (np.ones(256, np.float32), rng.exponential(1.0, 256).astype(np.float32) ** 3):
        ours = weighted_error(x, quantize_q4_0_weighted(x, importance), importance)
        ggml = weighted_error(x, quantize(x, Q4_0), importance)
        assert ours < 0.9 * ggml


def test_important_columns_get_the_smaller_errors():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    importance = np.ones(64, np.float32)
    importance[::4] = 100.0  # one column in four matters a hundred times more
    flat = dequantize(quantize_q4_0_weighted(x, np.ones(64, np.float32)), Q4_0, 64)
    weighted = dequantize(quantize_q4_0_weighted(x, importance), Q4_0, 64)
    sq = lambda y: float(((x - y)[:, ::4] ** 2).mean())  # noqa: E731
    assert sq(weighted) < 0.8 * sq(flat)


def test_a_block_on_the_q4_0_grid_comes_back_exactly():
    d = np.float32(0.125)  # an f16 scale
    q = np.array([np.arange(-8, 8), np.arange(7, -9, -1)], np.float32).reshape(1, 32)
    x = (d * q).astype(np.float32)
    out = dequantize(quantize_q4_0_weighted(x, np.ones(32, np.float32)), Q4_0, 32)
    np.testing.assert_array_equal(out, x)


def test_zero_rows_and_bad_shapes():
    out = quantize_q4_0_weighted(np.zeros((2, 64), np.float32), np.ones(64, np.float32))
    np.testing.assert_array_equal(dequantize(out, Q4_0, 64), np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="32-value blocks"):
        quantize_q4_0_weighted(np.zeros((1, 40), np.float32), np.ones(40, np.float32))
    with pytest.raises(ValueError, match="importances"):
        quantize_q4_0_weighted(np.zeros((1, 64), np.float32), np.ones(32, np.float32))
