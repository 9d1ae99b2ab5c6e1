"""Every attention architecture at odd head sizes against llama.cpp (#24).

The models are tests/helpers/odd_shapes.py's (head sizes 8, 12, 24, 40, 72, 80; GQA 1, 3, 5; n_embd 40 to
360; llama, qwen2, qwen3, gemma3, gemma2, granite, smollm3, phi3, and the attention layers of the
lfm2 and qwen35 hybrids; mamba has no heads), llama.cpp's outputs on them in
tests/data/odd_shape_refs.json (tests/refgen: one llama_decode of the prompt, F32 K/V cache, flash
attention off). Checked per model:
- the top-10 log-probs of every position within 1e-3, the top-1 equal where llama.cpp's margin
  exceeds 1e-3 (the shared tiny references' bounds), and llama.cpp's greedy continuation;
- the flash path with kvchat's default f16 cache: the prompt in one batch, in 5-token ubatches
  and token by token, bit-identical logits (batch invariance of the padded kernels).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.helpers.arch_refs import MARGIN, all_logits, log_softmax
from tests.helpers.odd_shapes import TOKENS, model_names, write_model

REFS = json.loads((Path(__file__).parent / "data" / "odd_shape_refs.json").read_text())
PARAMS = dict(n_ctx=512, n_batch=512, n_ubatch=512, type_k="f32", type_v="f32", flash_attn="off")  # the refs'
TOL = 1e-3


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("odd_shapes")


@pytest.fixture
def odd_model(odd_dir, request):
    m = Model.load(write_model(odd_dir, request.param))
    yield request.param, m
    m.close()


def _greedy(model, n_gen):
    ctx = Context(model, ContextParams(**PARAMS))
    assert ctx.decode(Batch.one_seq(TOKENS, 0)) == 0, ctx.last_error
    ids = []
    for i in range(n_gen):
        ids.append(int(np.argmax(ctx.get_logits_ith(-1))))
        assert ctx.decode(Batch.one_seq(ids[-1:], len(TOKENS) + i)) == 0, ctx.last_error
    return ids


@pytest.mark.parametrize("odd_model", model_names(), indirect=True)
def test_matches_llama_cpp(odd_model):
    name, m = odd_model
    ref = REFS["models"][name]
    lp = log_softmax(all_logits(m, TOKENS, **PARAMS))  # [n, n_vocab] f64
    worst, bad = 0.0, []
    for i, top in enumerate(ref["top10"]):
        worst = max(worst, max(abs(lp[i, t] - v) for t, v in top))
        if top[0][1] - top[1][1] > MARGIN and int(np.argmax(lp[i])) != top[0][0]:
            bad.append(i)
    assert not bad, f"{name}: top-1 differs from llama.cpp's at positions {bad}"
    assert worst <= TOL, f"{name}: max |Δ log-prob| over llama.cpp's top-10 {worst:.2e} > {TOL:g}"
    assert _greedy(m, REFS["n_gen"]) == ref["greedy"]


@pytest.mark.parametrize("odd_model", model_names(), indirect=True)
def test_flash_f16_logits_do_not_depend_on_the_split(odd_model):
    _, m = odd_model
    flash = dict(PARAMS, type_k="f16", type_v="f16", flash_attn="on")
    one = all_logits(m, TOKENS, **flash)
    for kw in (dict(n_ubatch=5), dict(n_ubatch=1, call=1)):
        np.testing.assert_array_equal(all_logits(m, TOKENS, **dict(flash, **kw)), one, err_msg=str(kw))


@pytest.mark.parametrize("odd_model", model_names(), indirect=True)
def test_speculative_drafts_give_the_plain_answer(odd_model):
    """A q4_0 self-draft (its head kept in the file's rows where q8_0's 32-value blocks do not
    divide n_embd) and n-gram drafts, every step drafting: greedy tokens equal plain greedy."""
    from kvchat.runtime.generate import generate
    from kvchat.runtime.speculative import make_speculator
    from kvchat.runtime.speculative.generate import generate_speculative

    name, m = odd_model

    def greedy(logits):
        return int(np.argmax(logits))

    prompt = list(TOKENS) + list(TOKENS[1:4])  # a repeat for the n-gram lookup
    plain = [s.token for s in generate(Context(m, ContextParams(**PARAMS)), greedy, prompt=prompt, max_tokens=24)]
    for kind in ("self:q4_0", "ngram"):
        ctx = Context(m, ContextParams(**PARAMS))
        spec = make_speculator(
            ctx, kind, draft_p_min=0.0
        )  # random weights: drafts are unsure; the machinery is under test
        spec.length.next = lambda: 3
        got = [s.token for s in generate_speculative(ctx, greedy, spec, prompt=prompt, max_tokens=24)]
        spec.close()
        assert got == plain, f"{name} {kind}"
        if kind != "ngram":  # a lookup drafts only where the answer repeats itself
            assert spec.stats.n_drafted > 0, f"{name} {kind}: no drafts"
