"""The needle probe (runtime/eval/kv_needle.py): prompts of the asked length with the needle at its
depth, the teacher-forced score against a plain all-logits decode, and `kv-sweep --needle`."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.eval.kv_needle import NEEDLE, QUESTION, needle_cases, run_needle, score_case
from kvchat.runtime.eval.kv_sweep import SweepConfig
from kvchat.runtime.eval.perplexity import make_context
from kvchat.runtime.generate import decode_tokens
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("needle")
    path = write_tiny_model(d / "llama.gguf", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=96)
    text = d / "t.txt"
    text.write_text(" the hello world and chat of a model" * 80)
    return path, text


def _contains(hay, needle):
    n = len(needle)
    return [i for i in range(len(hay) - n + 1) if list(hay[i : i + n]) == list(needle)]


def test_prompts_have_the_length_and_the_needle_at_its_depth(tiny):
    path, text = tiny
    m = Model.load(path)
    filler = m.vocab.tokenize(text.read_text(), add_special=True)
    cases = needle_cases(m, filler, [200, 260], depths=(0.0, 0.5, 1.0))
    needle = m.vocab.tokenize(NEEDLE.format(code="73915"), add_special=False)
    question = m.vocab.tokenize(QUESTION, add_special=False)
    assert [(c.length, c.depth) for c in cases] == [
        (200, 0.0),
        (200, 0.5),
        (200, 1.0),
        (260, 0.0),
        (260, 0.5),
        (260, 1.0),
    ]
    for c in cases:
        assert c.prompt.shape[0] == c.length
        at = _contains(c.prompt, needle)
        assert len(at) == 1
        n_fill = c.length - len(needle) - len(question)
        assert at[0] == round(c.depth * n_fill)
        assert list(c.prompt[-len(question) :]) == question
    with pytest.raises(KvchatError, match="only .* filler tokens"):
        needle_cases(m, filler[:50], [200])


def test_teacher_forced_score_matches_a_plain_decode(tiny):
    path, text = tiny
    m = Model.load(path)
    case = needle_cases(m, m.vocab.tokenize(text.read_text(), add_special=True), [200], depths=(0.5,))[0]
    ctx = make_context(m, 256, type_k="q8_0", type_v="q8_0")
    got = score_case(ctx, case)
    toks = np.concatenate([case.prompt, case.answer])
    ctx2 = make_context(m, 256, type_k="q8_0", type_v="q8_0")
    logits = decode_tokens(ctx2, toks, 0, 0, logits="all").astype(np.float64)
    n = case.prompt.shape[0]
    rows = logits[n - 1 : len(toks) - 1]
    lsm = rows - rows.max(1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(1, keepdims=True))
    want = lsm[np.arange(len(case.answer)), case.answer].sum()
    assert got["logprob"] == pytest.approx(want, abs=1e-4)
    assert got["correct"] == bool(np.all(rows.argmax(1) == case.answer))
    res = run_needle(m, [SweepConfig("q8_0", "q8_0")], [case])
    assert res[0].cases[0]["logprob"] == pytest.approx(got["logprob"], abs=1e-9)


def test_sweep_needle_lands_in_the_table_and_json(tiny, tmp_path):
    path, text = tiny
    js = tmp_path / "n.json"
    out = CliRunner().invoke(
        app,
        [
            "kv-sweep",
            "-m",
            str(path),
            "-f",
            str(text),
            "--k",
            "q4_0",
            "--v",
            "f16",
            "-c",
            "64",
            "--chunks",
            "1",
            "--pp",
            "0",
            "--tg",
            "0",
            "--needle",
            "--needle-len",
            "200",
            "--json",
            str(js),
        ],
    )
    assert out.exit_code == 0, (out.output, out.exception)
    assert "needle" in out.stdout and "200 tokens: found" in out.stdout
    doc = json.loads(js.read_text())
    assert {(r["type_k"], r["type_v"]) for r in doc["needle"]} == {("f16", "f16"), ("q4_0", "f16")}
    assert all({"length", "depth", "logprob", "correct"} <= set(r) for r in doc["needle"])
