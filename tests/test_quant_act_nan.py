"""Activation quantization keeps a NaN or an infinity visible (#24): integers cannot hold one, so the
block's scale d becomes NaN (kernels/quant_act.py), and every dot product with that block is NaN
— a damaged weight gives NaN logits the sampler refuses, not finite nonsense. Finite blocks keep
their bits: the same d and quants as when the row holds no NaN at all."""

import numpy as np
import pytest

from kvchat.kernels.matmul_int import quantize_activations
from kvchat.kernels.qlayout import ACT_Q8_0, ACT_Q8_1, ACT_Q8_K


@pytest.mark.parametrize("act, block", [(ACT_Q8_0, 32), (ACT_Q8_1, 32), (ACT_Q8_K, 256)], ids=["q8_0", "q8_1", "q8_K"])
def test_nan_and_inf_blocks_get_a_nan_scale_and_finite_blocks_keep_their_bits(act, block):
    rng = np.random.default_rng(1)
    clean = rng.standard_normal((2, 4 * block)).astype(np.float32)  # [2, 4 blocks]
    bad = clean.copy()
    bad[0, block + 3] = np.nan  # block 1: one NaN
    bad[0, 2 * block :] = np.nan  # block 2 and 3 of row 0: nothing but NaN (max |x| stays 0)
    bad[1, 5] = np.inf  # row 1, block 0: an infinity
    xq0, xd0, xs0, _ = quantize_activations(clean, act)
    xq, xd, xs, _ = quantize_activations(bad, act)
    assert np.isnan(xd[0, 1:]).all() and np.isnan(xd[1, 0])
    np.testing.assert_array_equal(xd[0, 0], xd0[0, 0])  # finite blocks: bit for bit as without NaN
    np.testing.assert_array_equal(xd[1, 1:], xd0[1, 1:])
    np.testing.assert_array_equal(xq[0, :block], xq0[0, :block])
    np.testing.assert_array_equal(xq[1, block:], xq0[1, block:])
    np.testing.assert_array_equal(xs[1, block // 16 :], xs0[1, block // 16 :])
