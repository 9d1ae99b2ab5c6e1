"""runtime/generate.py on a tiny random model: decode_tokens' pieces, generate's steps and stops."""

import threading

import numpy as np
import pytest

from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.generate import (
    DecodeError,
    Interrupted,
    StopReason,
    decode_tokens,
    generate,
    log_softmax_at,
    warm_up,
)
from kvchat.runtime.model import Model


@pytest.fixture(scope="module")
def model(tiny_model):
    return Model.load(tiny_model("llama"))


def make_ctx(model, n_ctx=256, n_batch=64, n_ubatch=64, abort=None):
    return Context(
        model,
        ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k="f32", type_v="f32", flash_attn="off"),
        abort_callback=abort,
    )


IDS = [int(t) for t in np.random.default_rng(5).integers(3, 250, 40)]


def test_decode_in_pieces_gives_the_logits_of_one_batch(model):
    """n_batch 7 splits 40 tokens into 6 decode calls; every row is bit-identical to one call."""
    whole = decode_tokens(make_ctx(model), IDS, 0, logits="all")
    pieces_ctx = make_ctx(model, n_batch=7, n_ubatch=7)
    pieces = decode_tokens(pieces_ctx, IDS, 0, logits="all")
    assert whole.shape == (40, model.hparams.n_vocab) and np.array_equal(whole, pieces)
    assert pieces_ctx.memory.seq_pos_max(0) == 39
    last = decode_tokens(make_ctx(model, n_batch=7, n_ubatch=7), IDS, 0)
    assert np.array_equal(last, whole[-1])
    assert decode_tokens(make_ctx(model), IDS, 0, logits="none") is None


def test_decode_continues_at_pos0_of_the_given_sequence(model):
    ctx = make_ctx(model)
    a = decode_tokens(ctx, IDS[:25], 0, logits="all")
    b = decode_tokens(ctx, IDS[25:], 25, logits="all")
    assert np.array_equal(np.concatenate([a, b]), decode_tokens(make_ctx(model), IDS, 0, logits="all"))


def test_interrupted_decode_says_how_many_tokens_stayed(model):
    calls = {"n": 0}

    def abort():
        calls["n"] += 1
        return calls["n"] == 3  # the third decode call (tokens 14..20) is stopped

    ctx = make_ctx(model, n_batch=7, n_ubatch=7, abort=abort)
    with pytest.raises(Interrupted) as e:
        decode_tokens(ctx, IDS, 0)
    assert e.value.n_done == 14 and ctx.memory.seq_pos_max(0) == 13


def test_no_room_is_a_decode_error_with_the_numbers(model):
    ctx = make_ctx(model, n_ctx=256, n_batch=256, n_ubatch=64)
    decode_tokens(ctx, IDS * 6, 0, logits="none")  # 240 cells used
    with pytest.raises(DecodeError) as e:
        decode_tokens(ctx, IDS, 240)
    assert e.value.code == 1 and e.value.n_done == 0
    assert str(e.value) == "no room in the KV cache for 40 tokens (240/256 used)"
    assert ctx.memory.seq_pos_max(0) == 239  # the refused batch left memory as it was


def greedy(logits):
    return int(np.argmax(logits))


def test_generate_yields_greedy_tokens_with_their_logprobs(model):
    gen = generate(make_ctx(model), greedy, prompt=IDS[:10], max_tokens=6)
    steps = list(gen)
    assert gen.stop == StopReason.LIMIT == "limit" and gen.n_decoded == 5 and gen.pos == 15
    # the same tokens by hand: argmax, decode, argmax, ...
    ctx = make_ctx(model)
    logits = decode_tokens(ctx, IDS[:10], 0)
    for i, step in enumerate(steps):
        assert step.index == i and step.token == int(np.argmax(logits))
        assert np.array_equal(step.logits, logits)
        x = logits.astype(np.float64)
        assert step.logprob == pytest.approx(x[step.token] - np.log(np.exp(x).sum()), abs=1e-9)
        logits = decode_tokens(ctx, [step.token], 10 + i)


def test_generate_stops_at_end_of_generation_without_yielding_it(model):
    first = list(generate(make_ctx(model), greedy, prompt=IDS[:10], max_tokens=4))
    eog = first[2].token
    gen = generate(make_ctx(model), greedy, prompt=IDS[:10], is_eog=lambda t: t == eog)
    assert [s.token for s in gen] == [s.token for s in first[:2]] and gen.stop == StopReason.EOG


def test_generate_stops_when_the_context_is_full(model):
    ctx = make_ctx(model, n_ctx=256, n_batch=256)
    gen = generate(ctx, greedy, prompt=(IDS * 7)[:250])
    assert len(list(gen)) == 6 and gen.stop == StopReason.CTX_FULL
    assert ctx.memory.seq_pos_max(0) == 255 and gen.pos == 256


def test_make_room_can_move_the_sequence(model):
    """A policy that drops the first 8 cells when full (a context shift) lets generation go on."""
    ctx = make_ctx(model, n_ctx=256, n_batch=256)
    shifts = []

    def make_room(pos, n):
        if pos + n <= 256:
            return pos
        shifts.append(pos)
        ctx.memory.seq_rm(0, 0, 8)
        ctx.memory.seq_add(0, 8, pos, -8)
        return pos - 8

    gen = generate(ctx, greedy, prompt=(IDS * 7)[:250], max_tokens=20, make_room=make_room)
    assert len(list(gen)) == 20 and gen.stop == StopReason.LIMIT
    assert shifts == [256, 256]  # 250 + 19 decoded tokens: full twice
    assert ctx.memory.seq_pos_max(0) == 250 + 19 - 2 * 8 - 1 == gen.pos - 1


def test_stop_event_interrupts_before_the_next_token(model):
    stop = threading.Event()
    gen = generate(make_ctx(model, abort=stop.is_set), greedy, prompt=IDS[:10], stop_event=stop)
    seen = []
    for step in gen:
        seen.append(step.token)
        if len(seen) == 3:
            stop.set()  # the decode of the 3rd token is aborted by the context
    assert len(seen) == 3 and gen.stop == StopReason.INTERRUPTED and gen.n_decoded == 2


def test_warm_up_leaves_the_memory_empty(model):
    ctx = make_ctx(model)
    warm_up(ctx, 1)
    assert ctx.memory.seq_pos_max(0) == -1


def test_log_softmax_at_is_exact_for_huge_logits():
    x = np.array([1000.0, 999.0, -np.inf], dtype=np.float32)
    assert log_softmax_at(x, 0) == pytest.approx(-np.log1p(np.exp(-1.0)), abs=1e-12)
    assert log_softmax_at(x, 2) == -np.inf


def test_on_logits_streams_each_piece_instead_of_keeping_them(model):
    whole = decode_tokens(make_ctx(model), IDS, 0, logits="all")
    seen = []
    got = decode_tokens(
        make_ctx(model, n_batch=16, n_ubatch=16),
        IDS,
        0,
        logits="all",
        on_logits=lambda i, rows: seen.append((i, rows.copy())),
    )
    assert got is None and [i for i, _ in seen] == [0, 16, 32]
    assert np.array_equal(np.concatenate([r for _, r in seen]), whole)


def test_decode_pieces_yields_only_the_masked_outputs(model):
    """perplexity's use: only positions 25..38 scored; the first piece (0..15) has none and
    yields nothing, the rows equal those of an all-logits decode bit for bit."""
    from kvchat.runtime.generate import decode_pieces

    whole = decode_tokens(make_ctx(model), IDS, 0, logits="all")
    mask = np.zeros(40, dtype=bool)
    mask[25:39] = True
    ctx = make_ctx(model, n_batch=16, n_ubatch=16)
    got = [(idx.copy(), rows.copy()) for idx, rows in decode_pieces(ctx, IDS, 0, outputs=mask)]
    assert [list(idx) for idx, _ in got] == [list(range(25, 32)), list(range(32, 39))]
    assert np.array_equal(np.concatenate([r for _, r in got]), whole[25:39])
    assert ctx.memory.seq_pos_max(0) == 39
    with pytest.raises(ValueError, match="mask has shape"):
        list(decode_pieces(ctx, IDS, 40, outputs=mask[:5]))
