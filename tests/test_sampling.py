"""The sampler chain against distributions computed by hand."""

import math

import numpy as np
import pytest

from kvchat.runtime.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    min_p,
    softmax,
    temperature,
    top_k,
    top_p,
)


def params(**kw):
    base = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=64, seed=1)
    base.update(kw)
    return SamplingParams(**base)


def probs_of(logits):
    e = [math.exp(x) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed) == (
        0.8,
        40,
        0.95,
        0.05,
        1.0,
        64,
        None,
    )


def test_no_filter_gives_plain_softmax():
    logits = np.array([1.0, 2.0, 0.5, 3.0], dtype=np.float32)
    ids, probs = Sampler(params()).candidates(logits)
    assert ids.tolist() == [3, 1, 0, 2]
    expected = probs_of([3.0, 2.0, 1.0, 0.5])
    assert probs == pytest.approx(expected, abs=1e-12)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -1.0, 0.5, 4.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1, 7, -3], 2.0)  # 7 and -3 are out of range: ignored
    assert out.tolist() == [1.0, -2.0, 0.5, 4.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 4.0]  # input untouched


def test_repetition_penalty_only_looks_at_last_n():
    logits = np.array([2.0, 2.0, 2.0], dtype=np.float32)
    s = Sampler(params(repeat_penalty=2.0, repeat_last_n=2))
    ids, probs = s.candidates(logits, history=[0, 1, 2, 2])  # window = [2, 2]: only id 2 penalised
    assert ids.tolist() == [0, 1, 2]
    assert probs == pytest.approx(probs_of([2.0, 2.0, 1.0]), abs=1e-12)
    s.params.repeat_last_n = 0
    _, probs = s.candidates(logits, history=[0, 1, 2])
    assert probs == pytest.approx([1 / 3] * 3)
    s.params.repeat_last_n = -1
    _, probs = s.candidates(logits, history=[0, 1])
    assert probs == pytest.approx(probs_of([2.0, 1.0, 1.0]), abs=1e-12)


def test_top_k_keeps_k_best_with_id_tiebreak():
    ids = np.arange(6, dtype=np.int64)
    lg = np.array([1.0, 5.0, 3.0, 3.0, 3.0, 0.0])
    kid, klg = top_k(ids, lg, 3)
    assert kid.tolist() == [1, 2, 3]
    assert klg.tolist() == [5.0, 3.0, 3.0]
    kid, _ = top_k(ids, lg, 0)
    assert kid.tolist() == [1, 2, 3, 4, 0, 5]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 exactly (log-space)
    lg = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    ids = np.arange(4, dtype=np.int64)
    assert top_p(ids, lg, 0.5)[0].tolist() == [0]  # 0.5 reaches 0.5
    assert top_p(ids, lg, 0.6)[0].tolist() == [0, 1]  # 0.75 needed
    assert top_p(ids, lg, 0.8)[0].tolist() == [0, 1, 2]  # 0.875
    assert top_p(ids, lg, 0.0)[0].tolist() == [0]  # min_keep
    assert top_p(ids, lg, 1.0)[0].tolist() == [0, 1, 2, 3]  # off


def test_min_p_threshold_relative_to_best():
    lg = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    ids = np.arange(4, dtype=np.int64)
    assert min_p(ids, lg, 0.5)[0].tolist() == [0, 1, 2]  # >= 0.2
    assert min_p(ids, lg, 0.76)[0].tolist() == [0]  # >= 0.304
    assert min_p(ids, lg, 0.0)[0].tolist() == [0, 1, 2, 3]


def test_temperature_scales_and_zero_is_greedy():
    ids = np.arange(3, dtype=np.int64)
    lg = np.array([2.0, 1.0, 0.0])
    assert temperature(ids, lg, 0.5)[1].tolist() == [4.0, 2.0, 0.0]
    gid, glg = temperature(ids, lg, 0.0)
    assert gid.tolist() == [0] and glg.tolist() == [2.0]


def test_full_chain_hand_computed():
    # logits for ids 0..5; history penalises id 5 (the best) with penalty 2
    logits = np.array([1.0, 0.0, 3.0, 2.0, 1.5, 4.0], dtype=np.float32)
    s = Sampler(params(repeat_penalty=2.0, top_k=5, top_p=0.9, min_p=0.3, temp=0.5))
    ids, probs = s.candidates(logits, history=[5])
    # penalty: id5 4.0 -> 2.0; top-5 sorted (drops id 1): 2(3.0) 3(2.0) 5(2.0) 4(1.5) 0(1.0)
    p5 = probs_of([3.0, 2.0, 2.0, 1.5, 1.0])  # .4775 .1756 .1756 .1065 .0646
    cum = np.cumsum(p5)
    assert cum[2] < 0.9 <= cum[3]  # top-p 0.9 keeps four: drops id 0
    # min-p 0.3 over the remaining four: keep p >= 0.3 * p_max, drops id 4
    p4 = probs_of([3.0, 2.0, 2.0, 1.5])
    assert p4[3] < 0.3 * p4[0] <= p4[2]
    assert ids.tolist() == [2, 3, 5]
    assert probs == pytest.approx(probs_of([6.0, 4.0, 4.0]), abs=1e-12)  # temp 0.5 doubles logits


def test_greedy_is_argmax_and_deterministic():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    for seed in (1, 2, 3):
        assert Sampler(SamplingParams(temp=0.0, seed=seed)).sample(logits) == int(np.argmax(logits))


def test_seeded_draws_are_reproducible_and_follow_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    a = Sampler(params(seed=42))
    b = Sampler(params(seed=42))
    draws_a = [a.sample(logits) for _ in range(4000)]
    draws_b = [b.sample(logits) for _ in range(4000)]
    assert draws_a == draws_b
    freq = np.bincount(draws_a, minlength=3) / 4000
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    c = Sampler(params(seed=43))
    assert [c.sample(logits) for _ in range(4000)] != draws_a
    a.reseed(42)
    assert [a.sample(logits) for _ in range(50)] == draws_a[:50]


def test_random_seed_is_recorded():
    s = Sampler(SamplingParams(seed=None))
    assert isinstance(s.seed, int)
    logits = np.zeros(10, dtype=np.float32)
    first = [s.sample(logits) for _ in range(20)]
    t = Sampler(SamplingParams(seed=s.seed))
    assert [t.sample(logits) for _ in range(20)] == first


@pytest.mark.parametrize(
    "bad", [dict(repeat_penalty=0.0), dict(min_p=1.5), dict(repeat_last_n=-2), dict(top_p=-0.1), dict(seed=-1)]
)
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))


def test_softmax_handles_minus_inf():
    p = softmax(np.array([0.0, -np.inf, 0.0]))
    assert p.tolist() == [0.5, 0.0, 0.5]
