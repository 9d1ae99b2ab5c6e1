"""Many sequences in one Context (runtime/serving/parallel.py) on a tiny random qwen3: alternatives of
one prompt (llama-batched) and continuous batching of many (llama-parallel) give, sequence by
sequence, the answer a solo Conversation gives; the shared prompt is decoded once; finished
sequences free their cells; a short newcomer produces before a long one's prefill is done."""

import numpy as np
import pytest

from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from kvchat.runtime.sampling import Sampler, SamplingParams
from kvchat.runtime.serving.parallel import ParallelRunner, Request, alternatives
from tests.helpers.gguf_factory import write_tiny_model

PROMPT = "hello world, this is a test of many sequences"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(
        tmp_path_factory.mktemp("par") / "q.gguf", arch="qwen3", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=96
    )
    return Model.load(path)


def solo(model, text, seed, temp, n_predict):
    """(answer ids, text) of a one-sequence Conversation in a fresh context (raw mode)."""
    ctx = Context(model, ContextParams(n_ctx=512))
    conv = Conversation(
        ctx,
        model.vocab,
        None,
        Sampler(SamplingParams(temp=temp, seed=seed)),
        ConversationConfig(raw=True, n_predict=n_predict),
    )
    n0 = len(conv.render([{"role": "user", "content": text}]))
    stats = conv.ask(text)
    ids = conv.tokens[n0:]
    if stats.stop == "limit":  # the last sampled token is not decoded
        ids = ids + [None]
    return ids, conv.messages[-1]["content"]


def ids_of(model, text):
    ctx = Context(model, ContextParams(n_ctx=256))
    conv = Conversation(ctx, model.vocab, None, Sampler(SamplingParams()), ConversationConfig(raw=True))
    return conv.render([{"role": "user", "content": text}])


@pytest.mark.slow  # over 10 s: left out of the fast lane (README), run by CI
@pytest.mark.parametrize("unified", [True, False])
def test_greedy_alternatives_are_four_copies_of_the_solo_answer(model, unified):
    ctx = Context(model, ContextParams(n_ctx=512 if unified else 2048, n_seq_max=4, kv_unified=unified))
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 4, n_predict=20)
    res = alternatives(runner, ids_of(model, PROMPT), [1, 2, 3, 4])
    want_ids, want_text = solo(model, PROMPT, 1, 0.0, 20)
    assert [r.text for r in res] == [want_text] * 4
    assert all(r.ids == want_ids[:-1] + [r.ids[-1]] and r.stop == "limit" and r.n_gen == 20 for r in res)
    assert ctx.memory.seq_pos_max(0) == -1 and all(c.get_used() == 0 for c in ctx.memory.cells)


@pytest.mark.parametrize("unified", [True, False])
def test_sampled_alternative_i_is_the_solo_answer_with_seed_s_plus_i(model, unified):
    ctx = Context(model, ContextParams(n_ctx=512 if unified else 2048, n_seq_max=4, kv_unified=unified))
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.9, seed=None), 4, n_predict=24)
    res = alternatives(runner, ids_of(model, PROMPT), [40, 41, 42, 43])
    texts = []
    for i, r in enumerate(res):
        want_ids, want_text = solo(model, PROMPT, 40 + i, 0.9, 24)
        assert r.seed == 40 + i and r.text == want_text
        assert r.ids[:-1] == want_ids[:-1]
        texts.append(r.text)
    assert len(set(texts)) == 4  # the seeds really differ


def test_the_prompt_is_decoded_once_with_every_sequence_on_its_cells(model):
    ctx = Context(model, ContextParams(n_ctx=512, n_seq_max=3))
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 3, n_predict=1)
    ids = ids_of(model, PROMPT)
    runner._prefill_shared(ids, [0, 1, 2])
    cells = ctx.memory.cells[0]
    assert cells.get_used() == len(ids) and runner.n_prompt_decoded == len(ids)
    assert cells.seq[: len(ids), :3].all() and np.array_equal(cells.pos[: len(ids)], np.arange(len(ids)))


PROMPTS = [f"question {i}: " + "why " * (i % 5) + "is the sky blue" for i in range(16)]


@pytest.mark.parametrize("unified", [True, False])
def test_sixteen_prompts_on_four_sequences_each_get_the_solo_greedy_answer(model, unified):
    ctx = Context(model, ContextParams(n_ctx=1024 if unified else 2560, n_seq_max=5, kv_unified=unified))
    system = "SYSTEM: answer briefly. "
    reqs = [Request(i, ids_of(model, system + p), seed=i) for i, p in enumerate(PROMPTS)]
    from os.path import commonprefix

    shared = list(commonprefix([r.ids for r in reqs]))
    assert len(shared) >= 5
    freed = []

    def on_result(res):  # called after the finished sequence's cells were freed
        freed.append(ctx.memory.seq_pos_max(res.seq_id))

    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 4, n_predict=12, prefill_budget=16)
    results = runner.run(reqs, on_result=on_result, shared_prefix=shared)
    assert [r.index for r in results] == list(range(16))
    for r, p in zip(results, PROMPTS):
        assert r.text == solo(model, system + p, 0, 0.0, 12)[1], r.index
        assert r.n_reused == len(shared) and r.n_prompt == len(reqs[r.index].ids)
    # the shared prefix was decoded once, every other prompt token once
    assert runner.n_prompt_decoded == len(shared) + sum(len(r.ids) - len(shared) for r in reqs)
    assert freed == [-1] * 16 and all(c.get_used() == 0 for c in ctx.memory.cells)
    assert len({r.seq_id for r in results}) == 4


def test_a_short_prompt_joining_mid_run_produces_before_a_long_prefill_finishes(model):
    ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=2))
    long_ids = ids_of(model, "long " * 80)
    reqs = [
        Request(0, ids_of(model, "short one"), seed=0),
        Request(1, long_ids, seed=0),
        Request(2, ids_of(model, "short two"), seed=0),
    ]
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 2, n_predict=3, prefill_budget=16)
    r0, r1, r2 = runner.run(reqs)
    assert r1.error is None and len(long_ids) > 200
    assert r2.step_admitted > 0  # joined the running batch when request 0 finished
    assert r2.step_admitted < r1.step_first and r2.step_first < r1.step_first
    assert r0.text == solo(model, "short one", 0, 0.0, 3)[1]
    assert r1.text == solo(model, "long " * 80, 0, 0.0, 3)[1]
    assert r2.text == solo(model, "short two", 0, 0.0, 3)[1]


def test_a_request_that_cannot_fit_is_reported_and_the_others_run(model):
    ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=2))
    reqs = [
        Request(0, ids_of(model, "fine"), seed=0),
        Request(1, ids_of(model, "big " * 400), seed=0),
        Request(2, [], seed=0),
        Request(3, None, seed=0, error="line 4: not JSON"),
    ]
    got = []
    runner = ParallelRunner(ctx, model.vocab, SamplingParams(temp=0.0), 2, n_predict=2)
    results = runner.run(reqs, on_result=lambda r: got.append(r.index))
    assert results[0].stop == "limit" and results[0].error is None
    assert results[1].stop == "error" and "holds at most 256" in results[1].error
    assert results[2].error == "the prompt is empty" and results[3].error == "line 4: not JSON"
    assert sorted(got) == [0, 1, 2, 3]
