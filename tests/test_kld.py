"""llama-perplexity's logits base file and KL-divergence statistics (runtime/eval/kld.py,
kernels/logprob.py): byte layout, 16-bit log-prob rows against a float64 log-softmax, the KLD /
Δp / same-top definitions against numpy, the CLI's two passes on a tiny model, and (where a
llama.cpp build exists) files exchanged with llama-perplexity."""

import math
import re
import struct

import numpy as np
import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.kernels.logprob import kld_rows, nll_rows, quantize_log_prob_rows, row_words
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.eval.kld import KLDStats, LogitsFile, LogitsFileWriter, n_scored
from tests.helpers.gguf_factory import write_tiny_model


def _log_softmax64(x):
    x = x.astype(np.float64)
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


def _logits(n, n_vocab, seed=0, spread=6.0):
    return (np.random.default_rng(seed).standard_normal((n, n_vocab)) * spread).astype(np.float32)


def _decode_rows(rows, n_vocab):
    head = rows[:, :4].copy().view(np.float32)  # [n, 2]: scale, min_log_prob
    return head[:, :1] * rows[:, 4 : 4 + n_vocab].astype(np.float32) + head[:, 1:2]


@pytest.mark.parametrize("n_vocab", [7, 50, 1001])
def test_stored_rows_decode_to_the_log_softmax_within_half_a_step(n_vocab):
    x = _logits(9, n_vocab)
    tok = np.arange(9, dtype=np.int64) % n_vocab
    rows = np.empty((9, row_words(n_vocab)), dtype=np.uint16)
    nll = np.empty(9)
    quantize_log_prob_rows(x, tok, rows, nll)
    ref = _log_softmax64(x)
    dec = _decode_rows(rows, n_vocab)
    scale = rows[:, :4].copy().view(np.float32)[:, 0]
    kept = ref > ref.max(1, keepdims=True) - 16  # below the 16-nat floor everything is stored as 0
    err = np.abs(dec - ref)
    assert np.all(err[kept] <= (scale[:, None] * 0.5 + 2e-5).repeat(n_vocab, 1)[kept])
    assert np.allclose(nll, -ref[np.arange(9), tok], atol=1e-5)
    assert rows.shape[1] == 2 * ((n_vocab + 1) // 2) + 4
    if n_vocab % 2:
        assert np.all(rows[:, -1] == 0)  # the padding word


def test_nll_rows_is_the_negative_log_softmax_of_the_target():
    x = _logits(5, 300, seed=3)
    tok = np.array([0, 17, 299, 5, 100], dtype=np.int64)
    out = np.empty(5)
    nll_rows(x, tok, out)
    assert np.allclose(out, -_log_softmax64(x)[np.arange(5), tok], atol=1e-5)


def test_kld_rows_match_the_definitions_in_numpy():
    n_vocab = 400
    base_logits = _logits(12, n_vocab, seed=1)
    q_logits = base_logits + _logits(12, n_vocab, seed=2, spread=0.3)
    q_logits[3] = base_logits[3]  # an identical row: KLD from the 16-bit rounding only
    tok = np.random.default_rng(4).integers(0, n_vocab, 12)
    rows = np.empty((12, row_words(n_vocab)), dtype=np.uint16)
    quantize_log_prob_rows(base_logits, tok, rows, np.empty(12))
    out = np.empty((12, 5))
    kld_rows(q_logits, rows, tok, out)

    lpb = _decode_rows(rows, n_vocab).astype(np.float64)
    lpq = _log_softmax64(q_logits)
    w = np.where(lpb > -16, np.exp(lpb), 0.0)
    kld = (w * (lpb - lpq)).sum(1)
    assert np.allclose(out[:, 0], -lpq[np.arange(12), tok], atol=1e-5)
    assert np.allclose(out[:, 1], -lpb[np.arange(12), tok], atol=1e-6)
    assert np.allclose(out[:, 2], kld, atol=1e-5)
    assert np.allclose(out[:, 3], np.exp(lpq[np.arange(12), tok]) - np.exp(lpb[np.arange(12), tok]), atol=1e-6)
    assert np.array_equal(out[:, 4], (lpq.argmax(1) == lpb.argmax(1)).astype(float))
    assert abs(out[3, 2]) < 5e-5 and out[3, 4] == 1.0


def test_base_file_layout_and_round_trip_are_byte_exact(tmp_path):
    n_ctx, n_vocab, n_chunk = 16, 11, 2
    k = n_scored(n_ctx)
    tokens = np.arange(n_ctx * n_chunk + 5) % n_vocab  # the tail past the last chunk is not written
    rows = np.random.default_rng(0).integers(0, 65535, (n_chunk * k, row_words(n_vocab))).astype(np.uint16)
    path = tmp_path / "base.kld"
    w = LogitsFileWriter(path, n_ctx, n_vocab, n_chunk, tokens)
    w.write_rows(rows[:k])
    assert not path.exists()  # only the .tmp file while writing
    w.write_rows(rows[k:])
    w.close()
    blob = path.read_bytes()
    assert blob[:8] == b"_logits_"
    assert struct.unpack("<iii", blob[8:20]) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(np.frombuffer(blob[20 : 20 + 4 * n_ctx * n_chunk], "<i4"), tokens[: n_ctx * n_chunk])
    assert len(blob) == 20 + 4 * n_ctx * n_chunk + 2 * rows.size
    f = LogitsFile(path)
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (n_ctx, n_vocab, n_chunk)
    assert np.array_equal(f.chunk_rows(1), rows[k:])
    assert np.array_equal(f.chunk_tokens(0), tokens[:n_ctx])


def test_bad_base_files_are_one_line_errors(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello world, not logits")
    with pytest.raises(KvchatError, match="not a logits base file"):
        LogitsFile(junk)
    path = tmp_path / "cut"
    w = LogitsFileWriter(path, 16, 11, 2, np.zeros(32, dtype=np.int64))
    w.write_rows(np.zeros((2 * n_scored(16), row_words(11)), dtype=np.uint16))
    w.close()
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(KvchatError, match="truncated.*only 1 complete"):
        LogitsFile(path)
    with pytest.raises(KvchatError, match="cannot read"):
        LogitsFile(tmp_path / "missing")


def test_an_aborted_writer_leaves_no_file(tmp_path):
    w = LogitsFileWriter(tmp_path / "b", 16, 11, 1, np.zeros(16, dtype=np.int64))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_statistics_follow_llama_perplexity_formulas():
    rng = np.random.default_rng(7)
    n_vocab, n = 64, 300
    base = _logits(n, n_vocab, seed=5, spread=3)
    q = base + rng.standard_normal((n, n_vocab)).astype(np.float32) * 0.2
    tok = rng.integers(0, n_vocab, n)
    rows = np.empty((n, row_words(n_vocab)), dtype=np.uint16)
    quantize_log_prob_rows(base, tok, rows, np.empty(n))
    st = KLDStats()
    st.add_rows(q[:100], rows[:100], tok[:100], np.arange(100))
    st.add_rows(q[100:], rows[100:], tok[100:], np.arange(200))
    kld, dp = st.values("kld").astype(np.float64), st.values("dp").astype(np.float64)
    mk, dmk = st.mean_kld()
    assert mk == pytest.approx(kld.mean(), rel=1e-6)
    assert dmk == pytest.approx(kld.std() / math.sqrt(n - 1), rel=1e-4)
    assert st.rms_dp()[0] == pytest.approx(math.sqrt((dp**2).mean()), rel=1e-5)
    nll, nllb = st.values("nll"), st.values("nll_base")
    assert st.ppl()[0] == pytest.approx(math.exp(nll.mean()), rel=1e-9)
    assert st.log_ppl_ratio()[0] == pytest.approx(nll.mean() - nllb.mean(), abs=1e-9)
    lines = st.report_lines()
    labels = [re.split(r":", l)[0] for l in lines if ":" in l]
    assert labels[:6] == [
        "Mean PPL(Q)                   ",
        "Mean PPL(base)                ",
        "Cor(ln(PPL(Q)), ln(PPL(base)))",
        "Mean ln(PPL(Q)/PPL(base))     ",
        "Mean PPL(Q)/PPL(base)         ",
        "Mean PPL(Q)-PPL(base)         ",
    ]
    assert [l[:11] for l in lines if "KLD:" in l] == [
        "Mean    KLD",
        "Maximum KLD",
        "99.9%   KLD",
        "99.0%   KLD",
        "95.0%   KLD",
        "90.0%   KLD",
        "Median  KLD",
        "10.0%   KLD",
        " 5.0%   KLD",
        " 1.0%   KLD",
        " 0.1%   KLD",
        "Minimum KLD",
    ]
    assert lines[-2].startswith("RMS Δp    : ") and " ± " in lines[-2]
    assert lines[-1].startswith("Same top p: ") and " ± " in lines[-1]
    assert float(re.search(r"Maximum KLD:\s+(\S+)", "\n".join(lines)).group(1)) == pytest.approx(kld.max(), abs=1e-6)
    assert KLDStats().report_lines() == []  # too few tokens: no closing statistics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("kld")
    path = write_tiny_model(d / "llama.gguf", arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=96)
    text = d / "t.txt"
    text.write_text(" the hello world and chat of a model" * 80)
    return path, text, d


def _run(*args):
    out = CliRunner().invoke(app, ["perplexity", *map(str, args)])
    assert out.exit_code == 0, (out.output, out.exception)
    return out.stdout


def test_two_passes_on_the_cli_score_a_configuration_against_its_base(tiny):
    path, text, d = tiny
    base = d / "f16.kld"
    first = _run("-m", path, "-f", text, "-c", 64, "-b", 32, "--chunks", 4, "--kl-divergence-base", base)
    ppl_base = float(re.search(r"Final estimate: PPL = (\S+)", first).group(1))
    assert LogitsFile(base).n_chunk == 4
    same = _run("-m", path, "--kl-divergence-base", base, "--kl-divergence")
    assert "chunk             PPL               ln(PPL(Q)/PPL(base))" in same
    assert re.search(r"^   4 ", same, re.M)
    mean_kld = float(re.search(r"Mean    KLD:\s+(\S+)", same).group(1))
    assert abs(mean_kld) < 5e-5  # only the 16-bit rounding of the base differs
    assert "Same top p: 100.000 ±" in same
    assert float(re.search(r"Mean PPL\(base\)\s+:\s+(\S+)", same).group(1)) == pytest.approx(ppl_base, rel=2e-4)
    q4 = _run("-m", path, "--kl-divergence-base", base, "--kl-divergence", "-ctk", "q4_0", "-ctv", "q4_0")
    assert float(re.search(r"Mean    KLD:\s+(\S+)", q4).group(1)) > 10 * max(mean_kld, 1e-6)


def test_kl_divergence_without_a_base_is_a_one_line_error(tiny):
    path, text, d = tiny
    out = CliRunner().invoke(app, ["perplexity", "-m", str(path), "--kl-divergence"])
    assert out.exit_code != 0 and "--kl-divergence-base" in str(out.exception)
    out = CliRunner().invoke(app, ["perplexity", "-m", str(path), "-f", str(text), "-ctv", "q4_0", "-fa", "off"])
    assert "needs flash attention" in str(out.exception)
    out = CliRunner().invoke(app, ["perplexity", "-m", str(path), "-f", str(text), "-ctk", "q3_k"])
    assert "invalid cache type 'q3_k'" in str(out.exception)
