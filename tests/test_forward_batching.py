"""The same text decoded as one batch, as ubatches of 512 / 7 tokens, and token by token gives
the same logits — bit for bit, with the default f16 KV cache too (the issue asks for 1e-3).

Why exact and not "close": K/V are stored rounded to the cache type, so a last-bit f32
difference between the one-token and the batched code paths flips an f16 rounding of a stored
value, and the flip grows over the layers (before the kernels were made batch-invariant,
SmolLM2's token-by-token logits differed from one-batch logits by up to 3e-2 with an f16 cache).
Every kernel of the forward pass now computes a token's row with the same operations in the
same order whatever the ubatch holds and whatever the thread count (kernels/matmul_kernels.py,
kernels/attention.py, norm/rope/act), and K/V written by earlier ubatches are found again
through the memory system (slots, masks, n_kv) — so all splits agree exactly.
The bits of a row depend on which cells hold the sequence (attention sums its cells in tiles
counted from cell 0), so "the same" means the same cells: a sequence placed elsewhere agrees
within float rounding only (the two-sequence test).
SmolLM2 for the real thing (f16 and q8_0 caches, flash on and off, 1 and 2 threads), Gemma-3
for the real iSWA cache (600 tokens through its 512-token window); a tiny gemma3 with a sliding
window of 8 for iSWA at every split; a tiny qwen3 with two sequences.
"""

import numba
import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model


def _logits_by_ubatch(model, tokens, n_ubatch, n_ctx=1024, **kw):
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_batch=len(tokens), n_ubatch=n_ubatch, **kw))
    assert ctx.decode(Batch.one_seq(tokens, 0, all_logits=True)) == 0, ctx.last_error
    return ctx.get_logits().copy()


def _logits_token_by_token(model, tokens, n_ctx=1024, **kw):
    ctx = Context(model, ContextParams(n_ctx=n_ctx, **kw))
    rows = []
    for i, t in enumerate(tokens):
        assert ctx.decode(Batch.one_seq([t], i, all_logits=True)) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    return np.stack(rows)


@pytest.fixture
def restore_threads():
    n = numba.get_num_threads()
    yield
    numba.set_num_threads(n)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("cache,flash", [("f16", "on"), ("f16", "off"), ("q8_0", "on")])
def test_smollm2_batch_splits_agree_exactly(smollm2_path, reference_dir, cache, flash, restore_threads):
    """600 tokens of GPL-3 (n_kv 768 for the batch, 256..512 for the early single tokens); the
    7-token ubatches and the single tokens run on one thread, the batches on two."""
    model = Model.load(smollm2_path)
    text = (reference_dir / "texts" / "GPL-3.txt").read_text()
    tokens = model.vocab.tokenize(text, add_special=True)[:600]
    kw = dict(type_k=cache, type_v=cache, flash_attn=flash)
    one = _logits_by_ubatch(model, tokens, n_ubatch=600, **kw)
    assert np.isfinite(one).all() and one.std() > 1.0  # real logits, not a degenerate output
    np.testing.assert_array_equal(_logits_by_ubatch(model, tokens, n_ubatch=512, **kw), one)
    numba.set_num_threads(1)
    np.testing.assert_array_equal(_logits_by_ubatch(model, tokens[:200], n_ubatch=7, n_threads=1, **kw), one[:200])
    np.testing.assert_array_equal(_logits_token_by_token(model, tokens[:100], n_threads=1, **kw), one[:100])


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_batch_splits_agree_exactly(gemma3_path, reference_dir, restore_threads):
    """Gemma-3 (iSWA, window 512, QK-norm, GELU), default f16 cache: 600 tokens, so the second
    512-token ubatch attends through the sliding window of the SWA layers."""
    model = Model.load(gemma3_path)
    text = (reference_dir / "texts" / "GPL-3.txt").read_text()
    tokens = model.vocab.tokenize(text, add_special=True)[:600]
    one = _logits_by_ubatch(model, tokens, n_ubatch=600)
    assert np.isfinite(one).all() and one.std() > 1.0
    np.testing.assert_array_equal(_logits_by_ubatch(model, tokens, n_ubatch=512), one)
    numba.set_num_threads(1)
    np.testing.assert_array_equal(_logits_by_ubatch(model, tokens[:64], n_ubatch=7, n_threads=1), one[:64])
    np.testing.assert_array_equal(_logits_token_by_token(model, tokens[:24], n_threads=1), one[:24])


@pytest.mark.parametrize("cache,flash", [("f16", "on"), ("f16", "off"), ("q8_0", "on")])
def test_tiny_gemma3_swa_batch_splits_agree(tmp_path, cache, flash):
    path = write_tiny_model(
        tmp_path / "g.gguf", arch="gemma3", n_layer=4, n_embd=128, n_head=4, n_head_kv=1, n_ff=96, n_swa=8
    )
    model = Model.load(path)
    tokens = list(np.random.default_rng(0).integers(6, model.hparams.n_vocab, 70))
    kw = dict(type_k=cache, type_v=cache, flash_attn=flash)
    one = _logits_by_ubatch(model, tokens, n_ubatch=70, **kw)
    for ub in (32, 7):
        np.testing.assert_array_equal(_logits_by_ubatch(model, tokens, n_ubatch=ub, **kw), one)
    np.testing.assert_array_equal(_logits_token_by_token(model, tokens, **kw), one)


def test_two_sequences_in_one_batch_do_not_see_each_other(tmp_path):
    """Sequences a and b in one batch: a's rows equal a decoded alone; b's rows equal b decoded
    in its own call after a (the same cells 20..34). b decoded alone sits at cells 0..14 instead,
    so its sums are grouped into other 32-cell tiles: equal within float rounding only."""
    path = write_tiny_model(tmp_path / "q.gguf", arch="qwen3", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=96)
    model = Model.load(path)
    a = list(range(10, 30))
    b = list(range(40, 55))
    alone_a = _logits_by_ubatch(model, a, n_ubatch=64)
    alone_b = _logits_by_ubatch(model, b, n_ubatch=64)
    ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=2))
    batch = Batch(
        a + b,
        pos=list(range(len(a))) + list(range(len(b))),
        seq_ids=[[0]] * len(a) + [[1]] * len(b),
        logits=[True] * (len(a) + len(b)),
    )
    assert ctx.decode(batch) == 0, ctx.last_error
    got = ctx.get_logits().copy()
    np.testing.assert_array_equal(got[: len(a)], alone_a)
    after = Context(model, ContextParams(n_ctx=256, n_seq_max=2))
    assert after.decode(Batch.one_seq(a, 0, seq_id=0, all_logits=True)) == 0, after.last_error
    assert after.decode(Batch.one_seq(b, 0, seq_id=1, all_logits=True)) == 0, after.last_error
    np.testing.assert_array_equal(got[len(a) :], after.get_logits())
    np.testing.assert_allclose(got[len(a) :], alone_b, rtol=0, atol=1e-5)
