"""`kvchat perplexity`: llama-perplexity's protocol (checked against a float64 forward on tiny
models, BOS replacement included), its output format, and SmolLM2 against perplexity.json.
The full 14-chunk runs of both models and three cache types are in docs/performance.md."""

import json
import math
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.runtime.eval.perplexity import compute_perplexity
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model
from tests.test_forward_logits import reference_forward


def _tiny(tmp_path, arch):
    return write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=96)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3's SPM vocab adds BOS
def test_protocol_matches_float64_reference(tmp_path, arch):
    path = _tiny(tmp_path, arch)
    model = Model.load(path)
    tokens = list(np.random.default_rng(0).integers(6, model.hparams.n_vocab, 3 * 64 + 10))
    res = compute_perplexity(model, tokens, n_ctx=64, n_batch=32, type_k="f32", type_v="f32", n_chunks=2)
    nll = []
    for c in range(2):
        chunk = tokens[c * 64 : (c + 1) * 64]
        if model.vocab.add_bos:
            chunk = [model.vocab.bos] + chunk[1:]
        lg = reference_forward(path, np.array(chunk))
        ls = lg - lg.max(1, keepdims=True)
        ls -= np.log(np.exp(ls).sum(1, keepdims=True))
        nll += [-ls[i, tokens[c * 64 + i + 1]] for i in range(32, 63)]  # second half, 31 tokens
        assert res.running[c] == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert res.n_scored == 62
    sd = np.std(nll) * math.sqrt(62 / 61) / math.sqrt(62) * res.ppl
    assert res.stderr == pytest.approx(sd, rel=1e-3)


def test_cli_prints_running_values_and_final_estimate(tmp_path):
    path = _tiny(tmp_path, "llama")
    text = tmp_path / "t.txt"
    text.write_text(" the hello world and chat" * 60)
    out = CliRunner().invoke(
        app,
        [
            "perplexity",
            "-m",
            str(path),
            "-f",
            str(text),
            "-c",
            "64",
            "-b",
            "32",
            "--chunks",
            "2",
            "-ctk",
            "q8_0",
            "-ctv",
            "q8_0",
        ],
    )
    assert out.exit_code == 0, out.output
    m = re.search(
        r"\[1\](\d+\.\d{4}),\[2\](\d+\.\d{4}),\nFinal estimate: PPL = (\d+\.\d{4}) \+/- \d+\.\d{5}", out.stdout
    )
    assert m, out.stdout
    assert m.group(2) == m.group(3)


def test_cli_rejects_a_short_text(tmp_path):
    path = _tiny(tmp_path, "llama")
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    out = CliRunner().invoke(app, ["perplexity", "-m", str(path), "-f", str(text), "-c", "64"])
    assert out.exit_code != 0
    assert "needs at least 128" in str(out.exception)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_first_chunks_match_llama_perplexity(smollm2_path, reference_dir):
    model = Model.load(smollm2_path)
    text = (reference_dir / "texts" / "GPL-3.txt").read_text()
    tokens = model.vocab.tokenize(text, add_special=True)
    ref = json.loads((reference_dir / "perplexity.json").read_text())["results"]["smollm2/f16"]
    res = compute_perplexity(model, tokens, n_chunks=3)
    # running value after 3 chunks within 1% plus llama.cpp's own spread across CPUs: the reference
    # was made on a Zen 4 (AVX-512) and reads 16.4097; llama-perplexity built here on an AVX2 EPYC
    # gives 16.3002 (-0.67%, same flags). kvchat here: 16.2249 (-0.46% from this machine's
    # llama.cpp, -1.13% from the reference); chunk 1 alone is further off: llama.cpp's 8-bit
    # activations add noise that raises its perplexity slightly (docs/performance.md)
    assert res.running[2] == pytest.approx(ref["chunks_running_ppl"][2], rel=0.01 + 0.0067)
    assert all(abs(a / b - 1) < 0.025 for a, b in zip(res.running, ref["chunks_running_ppl"]))
    off = compute_perplexity(model, tokens, n_chunks=1, flash_attn="off")
    # flash off sums the attention in another order; ggml's 8-bit activation rounding carries that
    # through the layers. llama.cpp's own chunk 1 moves 16.5546 -> 16.2777 (-1.7 %) with flash off
    # (llama-perplexity --kl-divergence, build of docs/performance.md); ours 16.43 -> 16.28 (-0.9 %)
    assert off.running[0] == pytest.approx(res.running[0], rel=0.025)
    assert off.running[0] != res.running[0]  # really the other attention path
