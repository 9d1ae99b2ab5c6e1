"""A sequence's logits do not depend on what else shares the batch and a unified KV cache
(runtime/memory/kv_view.py, issue #24): tiny models, one sequence decoded alone against the
same sequence decoded with three neighbours whose cells come before, between and after its
own (and a neighbour removed and replaced mid-run, so its cells are reused) — array_equal on
every logit row, flash attention on and off, a full cache and a sliding-window ring."""

import numpy as np
import pytest

from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model

N_PROMPT = 290  # crosses a 256-cell chunk and many 32-cell tiles
N_STEPS = 12


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model(request, tmp_path_factory):
    path = write_tiny_model(
        tmp_path_factory.mktemp("view") / f"{request.param}.gguf",
        arch=request.param,
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_head_kv=2,
        n_ff=96,
        n_swa=48,
    )
    return Model.load(path)


def _tokens(n, seed):
    return np.random.default_rng(seed).integers(3, 200, size=n).tolist()


def _solo(model, fa, prompt, steps):
    """Logit rows of the prompt's last token and of each teacher-forced step, the sequence alone."""
    ctx = Context(model, ContextParams(n_ctx=1024, n_ubatch=128, flash_attn=fa))
    assert ctx.decode(Batch(prompt)) == 0
    rows = [ctx.get_logits_ith(-1).copy()]
    for i, t in enumerate(steps):
        assert ctx.decode(Batch([t], pos=[len(prompt) + i])) == 0
        rows.append(ctx.get_logits_ith(-1).copy())
    return rows


def _shared(model, fa, prompt, steps):
    """The same rows for sequence 0 in a unified 4-sequence cache with neighbours 1-3."""
    ctx = Context(model, ContextParams(n_ctx=2048, n_ubatch=128, n_seq_max=4, flash_attn=fa))
    n1 = _tokens(37, 1)
    assert ctx.decode(Batch(n1, pos=list(range(37)), seq_ids=[1] * 37)) == 0  # cells before seq 0's
    n3 = _tokens(21, 3)  # seq 0's prompt and seq 3's in one batch, interleaved in blocks
    toks, pos, seqs = [], [], []
    for k, b in enumerate(range(0, N_PROMPT, 50)):
        toks += prompt[b : b + 50]
        pos += list(range(b, min(b + 50, N_PROMPT)))
        seqs += [0] * len(prompt[b : b + 50])
        if 7 * k < 21:
            toks += n3[7 * k : 7 * k + 7]
            pos += list(range(7 * k, 7 * k + 7))
            seqs += [3] * 7
    out = [False] * len(toks)
    last0 = max(i for i, s in enumerate(seqs) if s == 0)
    out[last0] = True
    assert ctx.decode(Batch(toks, pos=pos, seq_ids=seqs, logits=out)) == 0
    rows = [ctx.get_logits_ith(last0).copy()]
    p = {1: 37, 2: 0, 3: 21}
    extra = _tokens(N_STEPS * 4, 9)
    for i, t in enumerate(steps):
        if i == 4:  # seq 1 leaves: its cells (before seq 0's) become holes that seq 2 takes
            ctx.memory.seq_rm(1, -1, -1)
            del p[1]
        bt, bp, bs = [], [], []
        for s in sorted(p):  # one token of each neighbour, around seq 0's
            if s == 3:
                bt.append(t)
                bp.append(N_PROMPT + i)
                bs.append(0)
            bt.append(extra[4 * i + s])
            bp.append(p[s])
            bs.append(s)
            p[s] += 1
        out = [s == 0 for s in bs]
        assert ctx.decode(Batch(bt, pos=bp, seq_ids=bs, logits=out)) == 0
        rows.append(ctx.get_logits_ith(bs.index(0)).copy())
    return rows


@pytest.mark.parametrize("fa", ["on", "off"])
def test_a_sequences_logits_are_the_same_bits_alone_and_among_neighbours(model, fa):
    prompt, steps = _tokens(N_PROMPT, 0), _tokens(N_STEPS, 5)
    solo = _solo(model, fa, prompt, steps)
    shared = _shared(model, fa, prompt, steps)
    assert len(solo) == len(shared) == N_STEPS + 1
    for i, (a, b) in enumerate(zip(solo, shared)):
        assert np.array_equal(a, b), f"row {i}: max |d| {np.abs(a - b).max()}"
