"""Checks of one architecture against llama.cpp's outputs on a tiny reference model
(shared/reference/tiny: refs_<name>.json, its README gives the layout and settings).

The settings are the references' (n_ctx 2048, n_batch 2048, n_ubatch 512, F32 K/V cache, flash
attention off, add_special and parse_special on). What is checked, as issue 9 binds it:
- `kvchat logprobs` (cli/commands/logprobs.py, in-process): at every position of every reference
  prompt, |our log-prob - llama.cpp's| over llama.cpp's top-10 tokens, and the top-1 wherever
  llama.cpp's 1st-2nd margin exceeds 1e-3;
- the long prompt in one batch, in 7-token ubatches and token by token: bit-identical logits;
- the greedy continuation of the reference prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.conftest import REFERENCE_DIR

TINY = REFERENCE_DIR / "tiny"
REF_PARAMS = dict(n_ctx=2048, n_batch=2048, n_ubatch=512, type_k="f32", type_v="f32", flash_attn="off")
MARGIN = 1e-3  # top-1 is compared where llama.cpp's 1st-2nd margin exceeds this


def load_ref(name: str) -> dict:
    from tests.helpers import moe_models

    if name in moe_models.MODELS:  # tests/moe_refs (the model is written by the factory)
        return moe_models.load_refs(name)
    return json.loads((TINY / f"refs_{name}.json").read_text())


def model_path(name: str) -> Path:
    from tests.helpers import moe_models

    if name in moe_models.MODELS or name in moe_models.CHAT_MODELS:
        return moe_models.model_file(name)
    return TINY / f"{name}.gguf"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def all_logits(model, tokens, n_ubatch=512, call=None, **params) -> np.ndarray:
    """f32 [n, n_vocab] logits of every token, decoded in calls of `call` tokens (None = one
    call) with n_ubatch tokens per forward pass (other ContextParams as given, else REF_PARAMS)."""
    params = dict(REF_PARAMS, n_ubatch=n_ubatch, **params)
    ctx = Context(model, ContextParams(**params))
    step = call or len(tokens)
    rows = []
    for p0 in range(0, len(tokens), step):
        assert ctx.decode(Batch.one_seq(tokens[p0 : p0 + step], p0, all_logits=True)) == 0, ctx.last_error
        rows.append(ctx.get_logits().copy())
    return np.concatenate(rows)


def compare_entry(entry: dict, ours: list) -> tuple[float, list[int]]:
    """(max |Δ log-prob| over llama.cpp's top-10, positions where the top-1 differs although
    llama.cpp's margin exceeds MARGIN) for one reference prompt; `ours` is our top list per
    position as `kvchat logprobs` prints it (with enough entries to hold llama.cpp's top-10)."""
    worst, bad = 0.0, []
    for i, (ref, mine) in enumerate(zip(entry["positions"], ours)):
        got = {int(t): lp for t, lp in mine}
        for t, lp in ref["top"]:
            assert t in got, f"position {i}: llama.cpp's top token {t} is not in our list"
            worst = max(worst, abs(got[t] - lp))
        top = ref["top"]
        if top[0][1] - top[1][1] > MARGIN and mine[0][0] != top[0][0]:
            bad.append(i)
    return worst, bad


def logprobs_cli(name: str, prompt: str, tmp_path: Path, top: int = 64) -> dict:
    """`kvchat logprobs` with the references' settings on `prompt`, parsed."""
    from kvchat.cli.commands.logprobs import run_logprobs
    from kvchat.cli.options import ChatSettings

    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    s = ChatSettings(
        model=str(model_path(name)),
        ctx_size=2048,
        batch_size=2048,
        ubatch_size=512,
        cache_type_k="f32",
        cache_type_v="f32",
        flash_attn="off",
    )
    return json.loads(run_logprobs(s, f, top, parse_special=True))


def check_logprobs(name: str, tmp_path: Path, tol: float) -> float:
    """Every reference prompt through `kvchat logprobs`: same tokens, top-1 where decided, max
    |Δ| <= tol. Returns the max |Δ| seen."""
    ref = load_ref(name)
    worst = 0.0
    for entry in ref["logits"]:
        out = logprobs_cli(name, entry["prompt"], tmp_path)
        assert out["tokens"] == entry["tokens"], entry["name"]
        assert len(out["positions"]) == len(entry["positions"])
        d, bad = compare_entry(entry, [p["top"] for p in out["positions"]])
        assert not bad, f"{name} {entry['name']}: top-1 differs at {bad}"
        assert d <= tol, f"{name} {entry['name']}: max |Δ log-prob| {d:.2e} > {tol:g}"
        worst = max(worst, d)
    return worst


def check_split_invariance(name: str, **params) -> None:
    """The long prompt: one batch, 7-token ubatches, 7-token calls and token by token give the
    same logits, bit for bit."""
    ref = load_ref(name)
    tokens = next(e for e in ref["logits"] if e["name"] == "long")["tokens"]
    m = Model.load(model_path(name))
    try:
        one = all_logits(m, tokens, **params)
        for kw in (dict(n_ubatch=7), dict(call=7), dict(n_ubatch=1, call=1)):
            np.testing.assert_array_equal(all_logits(m, tokens, **kw, **params), one, err_msg=str(kw))
    finally:
        m.close()


def greedy_ids(model, prompt_tokens, n_gen: int) -> list[int]:
    """Prompt in one batch, then one token per decode, arg-max each time (the refs' protocol)."""
    ctx = Context(model, ContextParams(**REF_PARAMS))
    assert ctx.decode(Batch.one_seq(prompt_tokens, 0)) == 0
    ids, pos = [], len(prompt_tokens)
    for _ in range(n_gen):
        t = int(np.argmax(ctx.get_logits_ith(-1)))
        ids.append(t)
        assert ctx.decode(Batch.one_seq([t], pos)) == 0
        pos += 1
    return ids


def check_greedy(name: str, n_equal: int | None = None) -> None:
    g = load_ref(name)["greedy"]
    m = Model.load(model_path(name))
    try:
        assert m.vocab.tokenize(g["prompt"], add_special=True, parse_special=True) == g["tokens"]
        n = n_equal or g["n_gen"]
        assert greedy_ids(m, g["tokens"], n) == g["ids"][:n]
    finally:
        m.close()


def check_chat_and_run_q8(name: str, tmp_path: Path, capsys, monkeypatch, copy: bool = True) -> None:
    """A Q8_0 copy (written with gguf) loads and answers through `kvchat run` (stdout = the
    greedy continuation our engine computes on that copy of the chat-templated prompt) and
    `kvchat chat` (piped input). copy False: the model as it is (already quantized)."""
    import io

    from kvchat.cli.app import main
    from tests.helpers.gguf_factory import quantized_copy

    q8 = quantized_copy(model_path(name), tmp_path / f"{name}-q8_0.gguf") if copy else model_path(name)
    m = Model.load(q8)
    try:
        assert m.ftype_name == "Q8_0" or not copy
        from kvchat.runtime.text.chat_template import ChatTemplate

        text = ChatTemplate.from_gguf(m.gguf, m.vocab).render([{"role": "user", "content": "Once upon a time"}])
        prompt = m.vocab.tokenize(text, add_special=True, parse_special=True)
        want = m.vocab.detokenize(greedy_ids(m, prompt, 8))
    finally:
        m.close()
    main(
        [
            "run",
            "-m",
            str(q8),
            "-p",
            "Once upon a time",
            "-n",
            "8",
            "--temp",
            "0",
            "-c",
            "2048",
            "-ctk",
            "f32",
            "-ctv",
            "f32",
            "-fa",
            "off",
        ]
    )  # greedy_ids' settings
    assert capsys.readouterr().out.strip() == want.strip()  # the answer, without the reply's leading space
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    main(["chat", "-m", str(q8), "-n", "8", "--temp", "0", "-c", "512"])
    out = capsys.readouterr()
    assert out.out.strip() and "error" not in out.err.lower(), (out.out, out.err)


class ReferenceChecks:
    """The checks against llama.cpp that every tiny reference architecture passes, as a test
    class: subclass it in tests/test_arch_<name>.py as `class TestAgainstLlamaCpp(ReferenceChecks)`
    with `name` (the reference model's), `tol` (issue 9's max |Δ log-prob|) and `n_greedy` (how
    many greedy tokens must equal llama.cpp's; None = the whole continuation)."""

    name: str
    tol = 1e-3
    n_greedy = None
    chat_name = None  # the model the chat/run check quantizes, when not `name`

    def test_logprobs_match_llama_cpp_on_every_reference_prompt(self, tmp_path):
        assert check_logprobs(self.name, tmp_path, tol=self.tol) < self.tol

    def test_one_batch_ubatches_and_token_by_token_are_bit_identical(self):
        check_split_invariance(self.name)

    def test_greedy_continuation_matches_llama_cpp(self):
        check_greedy(self.name, n_equal=self.n_greedy)

    def test_a_q8_0_copy_runs_through_chat_and_run(self, tmp_path, capsys, monkeypatch):
        check_chat_and_run_q8(self.chat_name or self.name, tmp_path, capsys, monkeypatch)
