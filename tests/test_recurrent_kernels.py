"""The recurrent kernels against plain numpy written from the definitions (float64), and
split invariance: processing a sequence in pieces, carrying the state, gives the same bits
(conv, scan, the delta step)."""

import numpy as np
import pytest

from kvchat.kernels.conv import conv_with_state
from kvchat.kernels.delta_net import gated_delta_rule
from kvchat.kernels.ssm_scan import scan

RNG = np.random.default_rng(7)


def _f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def conv_ref(state, x, w):
    n_seqs, n_t, ch = x.shape
    xx = np.concatenate([state.astype(np.float64), np.transpose(x, (0, 2, 1))], axis=2)  # [s, ch, dc1+n_t]
    dc = w.shape[1]
    y = np.zeros((n_seqs, n_t, ch))
    for t in range(n_t):
        y[:, t, :] = np.einsum("sci,ci->sc", xx[:, :, t : t + dc], w.astype(np.float64))
    return y, xx[:, :, n_t:]


def test_conv_matches_numpy_and_returns_the_last_inputs_as_state():
    state, x, w = _f32(2, 24, 3), _f32(2, 9, 24), _f32(24, 4)
    y, ns = conv_with_state(state, x, w)
    y_ref, ns_ref = conv_ref(state, x, w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ns, ns_ref.astype(np.float32))


@pytest.mark.parametrize("cuts", [[1] * 9, [7, 2], [3, 3, 3], [9]])
def test_conv_in_pieces_is_bit_identical_to_one_call(cuts):
    state, x, w = _f32(2, 16, 2), _f32(2, 9, 16), _f32(16, 3)
    y_all, s_all = conv_with_state(state, x, w)
    st, ys, t0 = state, [], 0
    for c in cuts:
        y, st = conv_with_state(st, x[:, t0 : t0 + c], w)
        ys.append(y)
        t0 += c
    np.testing.assert_array_equal(np.concatenate(ys, axis=1), y_all)
    np.testing.assert_array_equal(st, s_all)


def scan_ref(s0, x, dt, A, B, C):
    s = s0.astype(np.float64).copy()
    n_seqs, n_t, d = x.shape
    y = np.zeros((n_seqs, n_t, d))
    for t in range(n_t):
        dts = np.where(dt[:, t] > 20, dt[:, t], np.log1p(np.exp(dt[:, t].astype(np.float64))))  # [s, d]
        s = s * np.exp(dts[:, :, None] * A[None]) + B[:, t, None, :] * (x[:, t] * dts)[:, :, None]
        y[:, t] = np.einsum("sdn,sn->sd", s, C[:, t])
    return y, s


def _scan_inputs(n_t=11):
    d, n = 32, 16
    A = -np.exp(RNG.uniform(0, 2, (d, n))).astype(np.float32)
    dt = _f32(2, n_t, d) * 2
    dt[0, 0, 0] = 25.0  # the softplus pass-through branch
    return _f32(2, d, n), _f32(2, n_t, d), dt, A, _f32(2, n_t, n), _f32(2, n_t, n)


def test_selective_scan_matches_numpy():
    s0, x, dt, A, B, C = _scan_inputs()
    y, s = scan(s0, x, dt, A, B, C)
    y_ref, s_ref = scan_ref(s0, x, dt, A, B, C)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)


def test_selective_scan_in_pieces_is_bit_identical_to_one_call():
    s0, x, dt, A, B, C = _scan_inputs()
    y_all, s_all = scan(s0, x, dt, A, B, C)
    st, ys = s0, []
    for a, b in [(0, 7), (7, 8), (8, 11)]:
        y, st = scan(st, x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b])
        ys.append(y)
    np.testing.assert_array_equal(np.concatenate(ys, axis=1), y_all)
    np.testing.assert_array_equal(st, s_all)


def delta_ref(q, k, v, g, b, state):
    """Token by token in float64 straight from the recurrence."""
    n_seqs, n_t, h_k, s_k = q.shape
    h_v = v.shape[2]
    m = state.astype(np.float64).copy()  # [s, H_v, S_v, S_k]
    o = np.zeros(v.shape)
    for t in range(n_t):
        for h in range(h_v):
            kt, qt = k[:, t, h % h_k].astype(np.float64), q[:, t, h % h_k] / np.sqrt(s_k)
            m[:, h] *= np.exp(g[:, t, h])[:, None, None]
            u = b[:, t, h, None] * (v[:, t, h] - np.einsum("sji,si->sj", m[:, h], kt))
            m[:, h] += u[:, :, None] * kt[:, None, :]
            o[:, t, h] = np.einsum("sji,si->sj", m[:, h], qt)
    return o, m


def _delta_inputs(n_t):
    h_k, h_v, s = 2, 4, 16
    q, k = _f32(2, n_t, h_k, s), _f32(2, n_t, h_k, s)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.abs(_f32(2, n_t, h_v, scale=0.3))
    b = (1 / (1 + np.exp(-_f32(2, n_t, h_v)))).astype(np.float32)
    return q, k, _f32(2, n_t, h_v, s), g, b, _f32(2, h_v, s, s, scale=0.1)


def test_gated_delta_rule_matches_the_recurrence():
    q, k, v, g, b, st = _delta_inputs(150)
    o_ref, m_ref = delta_ref(q, k, v, g, b, st)
    s = st.copy()
    o = gated_delta_rule(q, k, v, g, b, s)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(s, m_ref, rtol=1e-4, atol=2e-5)


def test_delta_step_in_pieces_is_bit_identical():
    q, k, v, g, b, st = _delta_inputs(20)
    s_all = st.copy()
    o_all = gated_delta_rule(q, k, v, g, b, s_all)
    s = st.copy()
    outs = [
        gated_delta_rule(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], b[:, t : t + 1], s)
        for t in range(20)
    ]
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), o_all)
    np.testing.assert_array_equal(s, s_all)
