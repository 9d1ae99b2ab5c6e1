"""The residual-add + RMSNorm kernels (kernels/fused_norm.py): bit-identical to the unfused steps
they replace, batch-invariant (a row alone == the row in a batch, on the serial and parallel
twins), and close to a float64 reference."""

import numpy as np
import pytest

from kvchat.kernels import parallel
from kvchat.kernels.fused_norm import add_rms_norm, norm_add_rms_norm
from kvchat.kernels.norm import rms_norm

D = 576
EPS = 1e-5


def _rows(n, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((n, D)) * scale).astype(np.float32)


def _ref_norm(x64, w):
    return x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + EPS) * w


@pytest.mark.parametrize("n", [1, 5, 40])
def test_add_rms_norm_equals_add_then_rms_norm_bit_for_bit(n):
    x, a, w = _rows(n, 0), _rows(n, 1), _rows(1, 2)[0]
    x_ref = x.copy()
    x_ref += a
    h_ref = rms_norm(x_ref, w, EPS)
    h = add_rms_norm(x, a, w, EPS)
    np.testing.assert_array_equal(x, x_ref)
    np.testing.assert_array_equal(h, h_ref)


@pytest.mark.parametrize("n", [1, 5, 40])
def test_norm_add_rms_norm_equals_the_three_steps_bit_for_bit(n):
    a, x, w_post, w_next = _rows(n, 3), _rows(n, 4), _rows(1, 5)[0], _rows(1, 6)[0]
    cur = rms_norm(a, w_post, EPS)
    x_ref = cur + x
    h_ref = rms_norm(x_ref, w_next, EPS)
    h = norm_add_rms_norm(a, w_post, x, w_next, EPS)
    np.testing.assert_array_equal(a, cur)
    np.testing.assert_array_equal(x, x_ref)
    np.testing.assert_array_equal(h, h_ref)


def test_fused_norms_match_a_float64_reference():
    x, a, w_post, w_next = _rows(6, 7), _rows(6, 8), _rows(1, 9)[0], _rows(1, 10)[0]
    x64, a64 = x.astype(np.float64), a.astype(np.float64)
    h = add_rms_norm(x.copy(), a, w_next, EPS)
    np.testing.assert_allclose(h, _ref_norm(x64 + a64, w_next), rtol=1e-5, atol=1e-5)
    cur64 = _ref_norm(a64, w_post)
    h2 = norm_add_rms_norm(a.copy(), w_post, x.copy(), w_next, EPS)
    np.testing.assert_allclose(h2, _ref_norm(x64 + cur64, w_next), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("par_min", [1, 1 << 30])  # every batch on the parallel / serial twin
def test_fused_norm_rows_are_batch_invariant(monkeypatch, par_min):
    monkeypatch.setattr(parallel, "RMS_NORM_PAR_MIN_ROWS", par_min)
    n = 33
    x, a, w_post, w_next = _rows(n, 11), _rows(n, 12), _rows(1, 13)[0], _rows(1, 14)[0]
    xb = x.copy()
    hb = add_rms_norm(xb, a, w_next, EPS)
    ab, xb2 = a.copy(), x.copy()
    hb2 = norm_add_rms_norm(ab, w_post, xb2, w_next, EPS)
    monkeypatch.setattr(parallel, "RMS_NORM_PAR_MIN_ROWS", 16)  # single rows: the default twin
    for t in (0, 17, n - 1):
        x1 = x[t : t + 1].copy()
        np.testing.assert_array_equal(add_rms_norm(x1, a[t : t + 1], w_next, EPS)[0], hb[t])
        np.testing.assert_array_equal(x1[0], xb[t])
        a1, x2 = a[t : t + 1].copy(), x[t : t + 1].copy()
        np.testing.assert_array_equal(norm_add_rms_norm(a1, w_post, x2, w_next, EPS)[0], hb2[t])
        np.testing.assert_array_equal(x2[0], xb2[t])


def test_fused_norm_refuses_a_non_contiguous_residual():
    x = _rows(4, 15)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        add_rms_norm(x, np.zeros_like(x), np.ones(x.shape[1], np.float32), EPS)
