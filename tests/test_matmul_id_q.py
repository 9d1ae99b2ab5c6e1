"""ExpertMatrix.matmul_id on block-quantized experts (kernels/matmul_id_q.py: every selected expert
in one launch, each activation row quantized once) against the per-expert path it replaces: each
pair's row array_equal to its expert's own QMatrix.matmul of that row, on both twins (serial and
parallel), for a decoded token and for a grouped ubatch; and batch invariance (a token's rows are
the same bits whatever else is in the ubatch)."""

from __future__ import annotations

import numpy as np
import pytest

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.matmul_id import ExpertMatrix
from tests.test_matmul import random_raw

N_EXPERT, K = 6, 512
M_GATE, M_UP = 40, 40  # 80 rows an expert: two whole row groups and a partial one
SERIAL, PARALLEL = 1 << 62, 0  # min_macs: every launch serial / parallel
# q4_K, q6_K (bit planes: long chunks run expanded to bytes), q8_0 (signed bytes), mxfp4 (f32 scales)
TYPES = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4]


def _experts(t):
    """(ExpertMatrix over gate | up, each expert's own QMatrix on the same rows)."""
    gate = random_raw(t, N_EXPERT * M_GATE, K, seed=1)
    up = random_raw(t, N_EXPERT * M_UP, K, seed=2)
    em = ExpertMatrix([gate, up], int(t), K, N_EXPERT)
    own = [
        QMatrix(np.concatenate([gate[e * M_GATE : (e + 1) * M_GATE], up[e * M_UP : (e + 1) * M_UP]]), int(t), K)
        for e in range(N_EXPERT)
    ]
    return em, own


def _routes(rng, n, k_used):
    return np.stack([rng.permutation(N_EXPERT)[:k_used] for _ in range(n)]).astype(np.int32)


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def experts(request):
    return _experts(request.param)


@pytest.mark.parametrize("min_macs", [SERIAL, PARALLEL], ids=["serial", "parallel"])
def test_a_decoded_tokens_experts_equal_their_own_matmuls_bit_for_bit(experts, min_macs):
    em, own = experts
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, K)).astype(np.float32)
    ids = np.array([[4, 0, 5]], np.int32)
    y = em.matmul_id(x, ids, min_macs)  # [1, 3, 80]
    assert y.shape == (1, 3, M_GATE + M_UP)
    for s, e in enumerate(ids[0]):
        np.testing.assert_array_equal(y[0, s], own[e].matmul(x, min_macs)[0])
    xs = rng.standard_normal((1, 3, K)).astype(np.float32)  # a row per slot (the down projection)
    ys = em.matmul_id(xs, ids, min_macs)
    for s, e in enumerate(ids[0]):
        np.testing.assert_array_equal(ys[0, s], own[e].matmul(xs[0, s : s + 1])[0])


@pytest.mark.parametrize("min_macs", [SERIAL, PARALLEL], ids=["serial", "parallel"])
def test_a_ubatchs_pairs_equal_their_experts_own_matmuls_bit_for_bit(experts, min_macs):
    em, own = experts
    rng = np.random.default_rng(4)
    n, k_used = 45, 3  # ~22 pairs an expert: chunks of 16+ tokens take the expanded path of q6_K
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = rng.standard_normal((n, k_used, K)).astype(np.float32)
    ids = _routes(rng, n, k_used)
    y, ys = em.matmul_id(x, ids, min_macs), em.matmul_id(xs, ids, min_macs)
    for e in range(N_EXPERT):
        t, s = np.nonzero(ids == e)
        np.testing.assert_array_equal(y[t, s], own[e].matmul(x[t]))
        np.testing.assert_array_equal(ys[t, s], own[e].matmul(xs[t, s]))


def test_a_tokens_rows_do_not_depend_on_the_rest_of_the_ubatch(experts):
    em, _ = experts
    rng = np.random.default_rng(5)
    n, k_used = 37, 4
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = rng.standard_normal((n, k_used, K)).astype(np.float32)
    ids = _routes(rng, n, k_used)
    y, ys = em.matmul_id(x, ids, PARALLEL), em.matmul_id(xs, ids, SERIAL)
    np.testing.assert_array_equal(em.matmul_id(x[5:30], ids[5:30], SERIAL), y[5:30])
    for t in (0, 17, 36):
        np.testing.assert_array_equal(em.matmul_id(x[t : t + 1], ids[t : t + 1])[0], y[t])
        np.testing.assert_array_equal(em.matmul_id(xs[t : t + 1], ids[t : t + 1], PARALLEL)[0], ys[t])


def test_the_experts_are_held_once_stacked_and_come_back_from_their_packing():
    em, own = _experts(GGMLType.Q4_K)
    assert em.experts == []  # no per-expert copy next to the stack
    assert em.packed_nbytes == sum(q.packed_nbytes for q in own)
    kind, arrays = em.packing()
    assert all(a.shape[0] == N_EXPERT for a in arrays)
    again = ExpertMatrix([], int(GGMLType.Q4_K), K, N_EXPERT, packed=(kind, arrays), ms=(M_GATE, M_UP))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, K)).astype(np.float32)
    ids = _routes(rng, 9, 2)
    np.testing.assert_array_equal(again.matmul_id(x, ids), em.matmul_id(x, ids))


def test_an_expert_chosen_twice_by_one_token_gets_the_same_row_twice():
    em, own = _experts(GGMLType.Q8_0)
    x = np.random.default_rng(7).standard_normal((1, K)).astype(np.float32)
    y = em.matmul_id(x, np.array([[2, 2]], np.int32))
    np.testing.assert_array_equal(y[0, 0], own[2].matmul(x)[0])
    np.testing.assert_array_equal(y[0, 1], y[0, 0])
