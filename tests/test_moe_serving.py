"""Mixture-of-experts models through the serving features dense models have (issue 25): sessions
(`run --session`, and a sequence's state saved and restored bit for bit), context shift, `run -np`,
the persistent prompt cache and `kv-sweep`, on the tiny MoE models of tests/helpers/moe_models.py:
qwen3moe (one KV cache) and gpt-oss (iSWA: sliding and full layers, attention sinks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.helpers import moe_models
from tests.helpers.cli_inproc import kvchat

MODELS = ["qwen3moe_s1_chat", "gpt_oss_s1_chat"]
PROMPT = "Once upon a time there was a little robot who lived by the sea and"


@pytest.fixture(params=MODELS)
def moe_model(request):
    return moe_models.model_file(request.param)


def ok(*args, **kw):
    r = kvchat(*args, **kw)
    assert r.returncode == 0, r.stderr
    return r


def test_a_saved_sequence_state_restores_a_moe_context_bit_for_bit(moe_model):
    m = Model.load(moe_model)
    try:
        toks = m.vocab.tokenize(PROMPT, add_special=True)
        params = ContextParams(n_ctx=256, n_batch=256, n_ubatch=64, type_k="f16", type_v="f16")
        a = Context(m, params)
        assert a.decode(Batch.one_seq(toks, 0)) == 0
        blob = a.state_seq_get_data(0)
        b = Context(m, params)
        assert b.state_seq_set_data(blob, 0) == len(blob)
        nxt = [int(np.argmax(a.get_logits_ith(-1)))]
        for ctx in (a, b):
            assert ctx.decode(Batch.one_seq(nxt, len(toks))) == 0
        np.testing.assert_array_equal(a.get_logits_ith(-1), b.get_logits_ith(-1))
    finally:
        m.close()


def test_run_with_session_resumes_a_moe_conversation_with_its_cached_prefix(moe_model, tmp_path):
    from kvchat.cli.session.session import decode_session

    sess = tmp_path / "s.kvs"
    base = ("run", "-m", moe_model, "-c", "512", "--temp", "0", "-n", "6", "--session", sess)
    r1 = ok(*base, "-p", "My name is Ada.")
    first = decode_session(sess.read_bytes())
    assert [x["role"] for x in first.messages] == ["user", "assistant"]
    assert first.messages[1]["content"].strip() == r1.stdout.strip()
    r2 = ok(*base, "-p", "What is my name?")
    assert f"resumed {sess}: {len(first.tokens)} tokens in the cache" in " ".join(r2.stderr.split())
    second = decode_session(sess.read_bytes())
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert second.messages[3]["content"].strip() == r2.stdout.strip()


@pytest.mark.slow  # over 10 s: left out of the fast lane (README), run by CI
def test_context_shift_lets_a_moe_model_answer_past_its_context_whatever_the_ubatch(moe_model):
    """-c 256 and 300 tokens to generate: the cache shifts (gpt-oss: a full-size sliding-window cache,
    --swa-full, as llama.cpp requires) and the answer is the same bits in ubatches of 64, 7 and 1."""
    args = ("run", "-m", moe_model, "-c", "256", "-n", "300", "--ignore-eos", "--temp", "0", "--swa-full", "-p", PROMPT)
    outs = [ok(*args, "-ub", str(ub)).stdout for ub in (64, 7, 1)]
    assert outs[0] == outs[1] == outs[2]
    m = Model.load(moe_model)
    try:
        n_prompt = len(m.vocab.tokenize(PROMPT, add_special=True))
        assert n_prompt + len(m.vocab.tokenize(outs[0], add_special=False)) > 256 + 10  # ran past the context
    finally:
        m.close()
    off = kvchat(*args, "--no-context-shift")
    assert off.returncode == 0 and len(off.stdout) < len(outs[0])


def test_np_answers_of_a_moe_model_equal_single_runs(moe_model):
    r = ok("run", "-m", moe_model, "-p", "hello there", "-np", "3", "-n", "6", "--temp", "0.9", "-s", "70", "--jsonl")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["seed"] for x in rows] == [70, 71, 72]
    for x in rows:
        solo = ok("run", "-m", moe_model, "-p", "hello there", "-n", "6", "--temp", "0.9", "-s", x["seed"])
        assert solo.stdout == x["text"] + "\n" and x["n_gen"] == 6


def test_prompt_cache_reuses_a_moe_prefix_and_answers_the_same(moe_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("lorem ipsum dolor sit amet " * 60)
    args = ("run", "-m", moe_model, "-f", doc, "--temp", "0", "-n", "8", "-c", "2048")
    first, second = ok(*args, "--prompt-cache", tmp_path / "pc"), ok(*args, "--prompt-cache", tmp_path / "pc")

    def reused(r):
        line = next(l for l in r.stderr.splitlines() if l.startswith("prompt cache: reused "))
        return tuple(int(v) for v in line.split()[3].split("/"))

    (n0, m0), (n1, m1) = reused(first), reused(second)
    assert n0 == 0 and m1 == m0 > 300 and m0 - n1 <= 128
    assert second.stdout == first.stdout == ok(*args, "--no-prompt-cache").stdout


def test_kv_sweep_on_a_moe_model_equals_the_two_pass_route(tmp_path):
    from kvchat.runtime.eval.kv_sweep import SweepConfig
    from tests.helpers.sweep_pairs import sweep_and_two_pass

    model = Model.load(moe_models.model_file("gpt_oss_s1"))
    try:
        tokens = model.vocab.tokenize(" the hello world and chat of a model" * 40, add_special=True)
        configs = [SweepConfig("q8_0", "q8_0"), SweepConfig("q4_0", "f16")]
        ref_row, pairs = sweep_and_two_pass(model, tokens, configs, 2, tmp_path)
        assert len(pairs) == len(configs)
        for row, two in pairs:
            assert row.stats.count == two.count == 2 * 31
            assert np.array_equal(row.stats.values("kld"), two.values("kld"))
            assert row.stats.mean_kld()[0] > 1e-6
        assert ref_row.stats.same_top()[0] == 1.0
    finally:
        model.close()
    r = ok(
        "kv-sweep", "-m", moe_models.model_file("gpt_oss_s1"), "-f", _text(tmp_path), "--k", "q8_0", "--v", "f16",
        "-c", "64", "--chunks", "1", "--pp", "16", "--tg", "4",
    )  # fmt: skip
    assert "q8_0" in r.stdout


def _text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(" the hello world and chat of a model" * 40)
    return f
