"""kernels/hadamard.py: the chunked fast Walsh-Hadamard transform behind the cache rotation."""

import numpy as np
import pytest

from kvchat.kernels.hadamard import fwht_chunks
from kvchat.runtime.memory.attn_rotation import hadamard, rotate


@pytest.mark.parametrize("n,d", [(64, 64), (64, 192), (128, 256), (256, 256), (64, 576)])
def test_matches_the_matrix_product(n, d):
    x = np.random.default_rng(n + d).standard_normal((37, d)).astype(np.float32)  # [rows, d]
    want = (x.astype(np.float64).reshape(-1, n) @ hadamard(n).astype(np.float64)).reshape(x.shape)
    got = fwht_chunks(x, n)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(x).max() * np.sqrt(n))
    np.testing.assert_allclose(fwht_chunks(got, n), x, rtol=0, atol=1e-5)  # self-inverse


def test_a_row_is_bit_identical_whatever_the_batch():
    x = np.random.default_rng(5).standard_normal((300, 4, 64)).astype(np.float32)  # [n, heads, d]
    full = rotate(x, 64)
    for t in (0, 1, 150, 299):
        assert np.array_equal(rotate(x[t : t + 1], 64)[0], full[t])
    assert np.array_equal(rotate(x[7:19], 64), full[7:19])


def test_input_is_not_modified_and_bad_sizes_are_refused():
    x = np.arange(128, dtype=np.float32).reshape(2, 64)
    before = x.copy()
    fwht_chunks(x, 64)
    assert np.array_equal(x, before)
    with pytest.raises(ValueError, match="power of two"):
        fwht_chunks(x, 48)
    with pytest.raises(ValueError, match="chunks of 128"):
        fwht_chunks(np.zeros((2, 64), np.float32), 128)
