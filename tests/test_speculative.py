"""Speculative decoding (runtime/speculative/) on the tiny reference models — dense, iSWA,
recurrent, hybrid: a verify batch's rows are bit-identical to one-token decodes, and greedy
generation with any draft source gives the plain answer token for token and leaves the memory
holding what plain decoding leaves (state bytes equal), also when the answer stops inside a
verified run (token limit, end of generation, Ctrl-C) and across context shifts."""

import threading

import numba
import numpy as np
import pytest

from kvchat.kernels import parallel
from kvchat.kernels.launch_tuner import PARALLEL, SERIAL, LaunchTuner
from kvchat.runtime.batch import Batch
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.generate import StopReason, decode_tokens, generate
from kvchat.runtime.model import Model
from kvchat.runtime.speculative.generate import generate_speculative
from kvchat.runtime.speculative.ngram import NgramDraft
from kvchat.runtime.speculative.speculator import PROBE_EVERY, PROBE_MAX, DraftLength, Speculator

MODELS = ["llama3rope_s1", "gemma2_s1", "mamba_s1", "lfm2_s1", "qwen35_s1"]
PROMPT = [1, 500, 600, 700, 800, 900, 1000, 1100, 500, 600, 700, 800, 1200, 1300, 1400]


@pytest.fixture(scope="module", params=MODELS)
def model(request, reference_dir):
    m = Model.load(reference_dir / "tiny" / f"{request.param}.gguf")
    yield m
    m.close()


def context(model, n_ctx=256, stop=None):
    return Context(model, ContextParams(n_ctx=n_ctx, n_batch=256, n_ubatch=256), abort_callback=stop)


def greedy(logits):
    return int(np.argmax(logits))


class Oracle:
    """Drafts from a known answer, wrong at every third proposal's second token: accepted runs,
    rejections at every index, and drafts past the end."""

    name = "oracle"

    def __init__(self, n_prompt, answer, n_vocab):
        self.n_prompt, self.answer, self.n_vocab = n_prompt, list(answer), n_vocab
        self.calls = 0

    def propose(self, history, n_max, pos=None, seq=0):
        self.calls += 1
        g = len(history) - self.n_prompt
        out = self.answer[g : g + n_max] + [7] * max(0, g + n_max - len(self.answer))
        if self.calls % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % self.n_vocab
        return out

    def close(self):
        pass


def run(model, source=None, n=40, is_eog=None, stop_at=None, draft_max=5):
    """Greedy tokens, the stop reason, n_decoded and the sequence's state after generate()."""
    stop = threading.Event()
    ctx = context(model, stop=stop.is_set)
    spec = None
    if source is not None:
        spec = Speculator(source, draft_max=draft_max)
        spec.length.next = lambda: draft_max  # every step drafts: the paths under test, not the policy
    kw = dict(prompt=PROMPT, max_tokens=n, is_eog=is_eog, stop_event=stop)
    gen = generate(ctx, greedy, **kw) if spec is None else generate_speculative(ctx, greedy, spec, **kw)
    toks = []
    for step in gen:
        toks.append(step.token)
        if stop_at is not None and step.index == stop_at:
            stop.set()
    return toks, gen.stop, gen.n_decoded, ctx.state_seq_get_data(0), spec


def test_verify_batch_rows_are_bit_identical_to_one_token_decodes(model):
    ctx = context(model)
    n_threads = numba.get_num_threads()
    decode_tokens(ctx, PROMPT, 0)
    toks = [321, 4000, 77, 9000, 15, 2222, 31]
    p0 = len(PROMPT)
    ckpt = ctx.memory.seq_checkpoint(0)
    assert ctx.decode(Batch.one_seq(np.array(toks, np.int32), p0, 0, all_logits=True)) == 0
    rows = ctx.get_logits().copy()  # [7, n_vocab]
    state = ctx.state_seq_get_data(0)
    assert ctx.memory.seq_restore(0, ckpt)
    # the verify's own path: on the tuner's SERIAL arm every kernel runs on one thread
    ctx.launch.enabled, ctx.launch.arm = True, SERIAL
    assert ctx.decode_tuned(Batch.one_seq(np.array(toks, np.int32), p0, 0, all_logits=True)) == 0
    assert np.array_equal(ctx.get_logits(), rows) and ctx.state_seq_get_data(0) == state
    assert numba.get_num_threads() == n_threads  # restored after the call
    # on PARALLEL the matmuls take that arm's threshold (every one split), not decode()'s configured one
    assert ctx.memory.seq_restore(0, ckpt)
    ctx.launch.arm = PARALLEL
    seen = []
    forward = ctx.model.forward
    ctx.model.forward = lambda ub, mctx, **kw: seen.append(kw.get("min_macs")) or forward(ub, mctx, **kw)
    try:
        assert ctx.decode_tuned(Batch.one_seq(np.array(toks, np.int32), p0, 0, all_logits=True)) == 0
    finally:
        del ctx.model.forward
    assert seen == [LaunchTuner.min_macs(PARALLEL)] and seen[0] < parallel.MATMUL_PAR_MIN_MACS
    assert np.array_equal(ctx.get_logits(), rows) and ctx.state_seq_get_data(0) == state
    assert ctx.memory.seq_restore(0, ckpt)
    for i, t in enumerate(toks):
        one = decode_tokens(ctx, [t], p0 + i)
        assert np.array_equal(one, rows[i]), f"row {i}"


def test_greedy_with_drafts_is_plain_greedy_and_leaves_the_same_memory(model):
    plain, stop, n_dec, state, _ = run(model)
    assert stop == StopReason.LIMIT and len(plain) == 40
    for source in (Oracle(len(PROMPT), plain, model.hparams.n_vocab), NgramDraft(3, 1)):
        toks, stop2, n_dec2, state2, spec = run(model, source)
        assert toks == plain, source.name
        assert (stop2, n_dec2) == (stop, n_dec)
        assert state2 == state, f"{source.name}: the memory differs from plain decoding's"
        if source.name == "oracle":  # every step drafts; every third proposal has a wrong token
            assert spec.stats.n_verify > 0 and 0 < spec.stats.n_accepted < spec.stats.n_drafted


@pytest.mark.parametrize("n", [5, 6, 7, 13])
def test_a_token_limit_inside_a_verified_run_leaves_what_plain_decoding_leaves(model, n):
    plain, stop, n_dec, state, _ = run(model, n=n)
    oracle = Oracle(len(PROMPT), run(model, n=40)[0], model.hparams.n_vocab)
    toks, stop2, n_dec2, state2, spec = run(model, oracle, n=n)
    assert (toks, stop2, n_dec2) == (plain, stop, n_dec)
    assert state2 == state
    assert spec.stats.n_accepted > 0


@pytest.mark.parametrize("at", [3, 8])
def test_end_of_generation_inside_a_verified_run(model, at):
    ref = run(model, n=40)[0]
    eog = ref[at]
    is_eog = lambda t: t == eog  # noqa: E731
    plain, stop, n_dec, state, _ = run(model, is_eog=is_eog)
    assert stop == StopReason.EOG
    toks, stop2, n_dec2, state2, _ = run(model, Oracle(len(PROMPT), ref, model.hparams.n_vocab), is_eog=is_eog)
    assert (toks, stop2, n_dec2) == (plain, stop, n_dec)
    assert state2 == state


@pytest.mark.parametrize("at", [0, 4, 9])
def test_ctrl_c_inside_a_verified_run(model, at):
    ref = run(model, n=40)[0]
    plain, stop, n_dec, state, _ = run(model, stop_at=at)
    assert stop == StopReason.INTERRUPTED
    toks, stop2, n_dec2, state2, _ = run(model, Oracle(len(PROMPT), ref, model.hparams.n_vocab), stop_at=at)
    assert (toks, stop2, n_dec2) == (plain, stop, n_dec)
    assert state2 == state


def test_draft_length_falls_to_plain_steps_when_drafts_fail_and_probes_again():
    dl = DraftLength(draft_max=8, draft_min=0)
    for _ in range(3):
        dl.record_decode(1, 0.010)
        dl.record_decode(5, 0.016)
    assert dl.next() == 2  # prior p = 0.5, a batch of n costs 1 + 0.15 (n - 1) tokens: 2 drafts pay best
    for _ in range(30):
        dl.record_draft(4, 0, True, 0.0)
    ks = [dl.next() for _ in range(32)]
    assert ks.count(0) >= 30 and max(ks) >= 1  # plain steps, with a probe now and then
    for _ in range(30):
        dl.record_draft(4, 4, False, 0.0)
    assert dl.next() == 8  # all accepted: the longest drafts


def test_one_slow_draft_does_not_stop_drafting_for_the_rest_of_the_run():
    """A proposal that took 10x (a descheduled thread on a shared machine) makes drafting look
    unprofitable for a while; the estimates are medians, so two normal probes bring it back, and
    probes come at most PROBE_MAX plain steps apart."""

    dl = DraftLength(draft_max=4)
    for n, t in ((1, 0.028), (2, 0.033), (3, 0.036), (5, 0.047)):
        for _ in range(3):
            dl.record_decode(n, t)
    dl.record_decode(4, 0.300)  # a batch size's first decode loads its code paths: not a sample
    dl.record_draft(2, 2, False, 2 * 0.500)  # the first draft steps load the draft's kernels: neither
    dl.record_draft(2, 2, False, 2 * 0.100)  # 100 ms a drafted token: 10x the draft's real cost
    assert dl.next() == 0 and dl.t_draft == 0.100 and 4 not in dl.t_size
    steps, drafted = 0, []
    while len(drafted) < 3:
        k = dl.next()
        steps += 1
        if k:
            drafted.append(steps)
            dl.record_draft(k, k, False, k * 0.010)  # the draft's real cost, all accepted
        assert steps <= 4 * PROBE_MAX, "no probe"
    assert drafted[1] - drafted[0] <= PROBE_MAX
    assert dl.next() >= 2 and dl.t_draft == 0.010  # drafting again, the outlier out of the median


@pytest.mark.parametrize("probe_max", [PROBE_EVERY, PROBE_MAX])
def test_failed_probes_back_off_up_to_the_sources_probe_max(probe_max):
    """A source whose probe first catches up on the skipped tokens (ModelDraft) backs off to
    PROBE_MAX plain steps between probes; one whose probe is its draft steps only (SelfDraft)
    probes every PROBE_EVERY."""
    dl = DraftLength(draft_max=4, probe_max=probe_max)
    for n in (1, 2, 3):
        for _ in range(4):
            dl.record_decode(n, 0.010 * (1 + 0.05 * (n - 1)))
    for _ in range(3):
        dl.record_draft(2, 0, True, 2 * 0.003)  # cheap drafts, always rejected: drafting does not pay
    gaps, last = [], 0
    for step in range(1, 400):
        if dl.next():
            gaps.append(step - last)
            last = step
            dl.record_draft(2, 0, True, 2 * 0.003)
    assert gaps[0] <= PROBE_EVERY and max(gaps) == gaps[-1] == probe_max


def test_no_probes_while_a_draft_step_costs_so_much_that_even_accepted_drafts_would_lose():
    """A draft step as dear as a target step: drafting cannot pay at any acceptance, so the
    probes (each a catch-up of the draft on the skipped tokens) wait HOPELESS_WAIT plain steps,
    then one is made anyway; with cheap draft steps they come every PROBE_EVERY."""
    from kvchat.runtime.speculative.speculator import HOPELESS_WAIT, PROBE_EVERY

    def length(t_draft, samples=3):
        dl = DraftLength(draft_max=4)
        for n, t in ((1, 0.0075), (2, 0.0085), (3, 0.0093), (5, 0.011)):
            for _ in range(1 + samples):  # a size's first decode is not a sample
                dl.record_decode(n, t)
        dl.acc, dl.trials = 0.0, 20.0  # drafts were rejected: plain steps, probes
        for _ in range(4):
            dl.record_draft(2, 0, True, 2 * t_draft)
        return dl

    dear = length(0.0080)
    assert dear.hopeless() and not length(0.0020).hopeless()
    assert not length(0.0080, samples=2).hopeless()  # two one-token times: not yet a verdict
    noisy = DraftLength(draft_max=4)  # steps of 7.5 ms, draft steps of 4 ms (d = 0.53): drafting can pay
    for n, t in ((1, 0.0075), (1, 0.0075), (1, 0.0075), (1, 0.0075), (2, 0.0085), (2, 0.030)):
        noisy.record_decode(n, t)  # the one 2-row verify timed was stretched 3x by a busy machine
    noisy.acc, noisy.trials = 0.0, 20.0
    for t in (0.004, 0.004, 0.012, 0.004, 0.004):
        noisy.record_draft(1, 0, True, t)
    assert noisy.t_size[2] == 0.030 and not noisy.hopeless()
    for _ in range(2):
        noisy.record_decode(2, 0.0085)
    assert not noisy.hopeless()  # three 2-row times, their median 8.5 ms
    ks = [dear.next() for _ in range(PROBE_EVERY + HOPELESS_WAIT)]
    assert ks[:-1] == [0] * (PROBE_EVERY + HOPELESS_WAIT - 1) and ks[-1] == 2
    cheap = length(0.0020)
    assert [cheap.next() for _ in range(PROBE_EVERY)][-1] == 2


def test_a_model_draft_times_its_draft_steps_not_its_catch_up_on_a_backlog(model):
    """A drafted token costs a one-token decode of the draft; the draft's catch-up on a backlog
    (the prompt, the tokens of plain steps) is one batch and says nothing about that cost."""
    from kvchat.runtime.speculative.draft_model import ModelDraft

    src = ModelDraft(context(model))
    h = list(PROMPT)
    d = src.propose(h, 1)  # catch-up on the whole prompt, no one-token decode
    assert len(d) == 1 and src.step_times == (0, 0.0)
    d = src.propose(h + d, 3)  # steady: one new token decoded, then two draft steps
    assert len(d) == 3 and src.step_times[0] == 3 and src.step_times[1] > 0
    h = h + d + [7]  # all accepted and a sampled token: a backlog of two
    assert len(src.propose(h, 3)) == 3 and src.step_times[0] == 2


def test_ngram_draft_continues_the_latest_match():
    src = NgramDraft(ngram_max=3, ngram_min=1)
    h = [5, 6, 7, 8, 9, 1, 5, 6, 7, 4, 2, 5, 6, 7]
    assert src.propose(h, 3) == [4, 2, 5]  # [5 6 7] last seen before 4 2 ...
    assert src.propose([1, 2, 3], 4) == []
    assert src.propose([3, 1, 2, 3], 4) == [1, 2, 3]


def test_ngram_draft_takes_the_longest_match_then_the_latest():
    h = [1, 2, 3, 4, 9, 5, 3, 4, 8, 1, 2, 3, 4]
    assert NgramDraft(ngram_max=12).propose(h, 3) == [9, 5, 3]  # [1 2 3 4] beats the later [3 4]
    assert NgramDraft(ngram_max=2).propose(h, 2) == [8, 1]  # keys of 2: the latest [3 4]
    assert NgramDraft(ngram_min=5).propose(h, 2) == []  # no earlier match of 5 tokens

    def reference(h, n_max, lo, hi):  # the longest key first, its latest earlier occurrence
        for size in range(min(hi, len(h) - 1), lo - 1, -1):
            key = h[len(h) - size :]
            for s in range(len(h) - size - 1, -1, -1):
                if h[s : s + size] == key:
                    return h[s + size : s + size + n_max]
        return []

    rng = np.random.default_rng(5)
    for _ in range(300):
        h = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 40)))]
        lo, hi = sorted(int(v) for v in rng.integers(1, 14, 2))
        assert NgramDraft(ngram_max=hi, ngram_min=lo).propose(h, 6) == reference(h, 6, lo, hi), (h, lo, hi)


def conversation(model, speculative=None, n_ctx=256, n_predict=40, temp=0.0):
    from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
    from kvchat.runtime.sampling import Sampler, SamplingParams

    ctx = context(model, n_ctx=n_ctx)
    conv = Conversation(
        ctx,
        model.vocab,
        None,
        Sampler(SamplingParams(temp=temp, seed=7)),
        ConversationConfig(n_predict=n_predict, raw=True, ignore_eos=True, keep=4),
    )
    conv.speculative = speculative
    return conv


@pytest.mark.slow  # over 10 s: left out of the fast lane (README), run by CI
def test_a_conversation_through_context_shifts_is_plain_decodings(model):
    """256 cells, answers of 300 tokens: several shifts inside speculative runs (dense, iSWA with
    its window; recurrent and hybrid memories stop at the full context, as plain ones do)."""

    plain = conversation(model, n_predict=300)
    spec = conversation(model, Speculator(NgramDraft(3, 1), draft_max=6), n_predict=300)
    _through_context_shifts(plain, spec)


@pytest.mark.slow
def test_a_self_draft_in_the_targets_memory_through_context_shifts_is_plain_decodings(model):
    """The same with the q4_0 copy drafting in the target's memory (self_draft.py): its rows come
    and go between the shifts' seq_rm / seq_add of the target's cells."""
    from kvchat.runtime.speculative import make_speculator

    plain = conversation(model, n_predict=300)
    spec = conversation(model, n_predict=300)
    spec.speculative = make_speculator(spec.ctx, "self:q4_0", draft_max=4, draft_p_min=0.0)
    assert type(spec.speculative.source).__name__ == "SelfDraft"
    spec.speculative.length.next = lambda: 4
    _through_context_shifts(plain, spec)


def _through_context_shifts(plain, spec):
    from kvchat.runtime.chat.events import PromptTooLong

    turns = []  # per conversation: each question's stop reason, or its refusal as too long
    for conv in (plain, spec):
        turns.append([])
        for question in ("one two three one two three one two three four", "five six five six"):
            try:
                turns[-1].append(conv.ask(question).stop)
            except PromptTooLong as e:
                turns[-1].append(str(e))
    assert turns[1] == turns[0]
    if plain.ctx.memory.get_can_trim():
        assert turns[0] == [StopReason.LIMIT] * 2  # shifted through
    else:  # a state cannot be shifted: the answer stops at the full context, the next question is refused
        assert turns[0][0] == StopReason.CTX_FULL and "fit in the context of 256 tokens" in turns[0][1]
    assert spec.tokens == plain.tokens and spec.messages == plain.messages
    assert (spec.n_dropped, spec.n_keep_shift) == (plain.n_dropped, plain.n_keep_shift)
    assert spec.session_state() == plain.session_state()
    assert spec.speculative.stats.n_drafted > 0


def test_a_seeded_sampled_answer_is_the_same_with_drafts(model):
    """temp 0.8: drafts are point masses, so "draw from the model, keep the draft while they
    agree" is the speculative-sampling rule and uses the same random numbers as plain sampling."""
    plain = conversation(model, temp=0.8, n_predict=60)
    spec = conversation(model, Speculator(NgramDraft(3, 1), draft_max=6), temp=0.8, n_predict=60)
    for conv in (plain, spec):
        conv.ask("one two three one two three one two three four")
    assert spec.tokens == plain.tokens
    assert spec.session_state() == plain.session_state()


def test_self_q4_0_drafts_give_the_plain_answer(model):
    """The model drafting for itself: a q4_0 copy of the (F32) weights in the target's memory."""
    from kvchat.runtime.speculative import make_speculator

    plain = conversation(model, n_predict=40)
    spec_conv = conversation(model, n_predict=40)
    spec_conv.speculative = make_speculator(spec_conv.ctx, "self:q4_0", draft_max=4, draft_p_min=0.0)
    for conv in (plain, spec_conv):
        conv.ask("one two three one two three one two three four")
    assert spec_conv.tokens == plain.tokens
    assert spec_conv.session_state() == plain.session_state()
    st = spec_conv.speculative.stats
    # drafts were made and checked; how many a random-weight model accepts is chance (CI once saw 0
    # of 6 where this machine sees more), so acceptance is measured on SmolLM2 (`kvchat bench --spec`)
    assert st.n_drafted > 0 and st.n_verify > 0


class _Rows:
    """A head's rows as draft_head.FileRows gives them: f32 rows of a random matrix."""

    ggml_type = 0  # GGMLType.F32

    def __init__(self, w):
        self.w = w

    def __call__(self, ids):
        return np.ascontiguousarray(self.w[ids]).view(np.uint8)


def test_a_draft_head_has_the_q8_0_rows_of_the_first_ids_and_of_the_conversations_tokens():
    from kvchat.kernels.ggml_types import GGMLType
    from kvchat.kernels.matmul import QMatrix
    from kvchat.kernels.quants import quantize
    from kvchat.runtime.speculative.draft_head import DraftHead

    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 64)).astype(np.float32)  # [n_vocab, k]
    h = rng.standard_normal((3, 64)).astype(np.float32)
    full = QMatrix(quantize(w, int(GGMLType.Q8_0)), int(GGMLType.Q8_0), 64).matmul(h)  # [3, 300]
    head = DraftHead(_Rows(w), 300, 64, n_base=100)
    out = head.matmul(h)
    np.testing.assert_array_equal(out[:, :100], full[:, :100])
    assert np.all(out[:, 100:] == -np.inf)
    head.add_tokens([5, 150, 299, 150])
    out = head.matmul(h)
    np.testing.assert_array_equal(out[:, [150, 299]], full[:, [150, 299]])
    others = np.setdiff1d(np.arange(100, 300), [150, 299])
    assert np.all(out[:, others] == -np.inf)
    np.testing.assert_array_equal(head.matmul(h[1]), out[1])  # a row alone: the same bits
    head.add_tokens([299, 7])  # nothing new: the extra rows stay
    np.testing.assert_array_equal(head.matmul(h), out)


def test_a_self_draft_looks_up_the_targets_embeddings_and_gives_the_conversation_head_rows(model):
    from kvchat.runtime.speculative import make_speculator

    ctx = context(model)
    spec = make_speculator(ctx, "self:q4_0", draft_max=3)
    draft = spec.source.ctx.model
    assert draft.weights.tok_embd is model.weights.tok_embd
    head = draft.weights.output
    rare = [t for t in (40000, 45000, 49000) if t < head.m]
    h = PROMPT + rare
    decode_tokens(ctx, h[:-1], 0, logits="none")  # the copy drafts in the target's memory (self_draft.py)
    spec.source.propose(h, 3, len(h) - 1, 0)
    logits = spec.source.ctx.get_logits_ith(-1)
    has_row = np.zeros(head.m, bool)
    has_row[: head.n_base] = True
    has_row[rare] = True
    assert np.isfinite(logits[has_row]).all()
    # the others are -inf (-softcap after gemma2's final soft-cap): never above a drafted token
    floor = logits[~has_row]
    assert np.all(floor == floor[0]) and floor[0] < logits[has_row].min()
    spec.close()


def test_a_tuned_batch_larger_than_a_verify_runs_as_a_prompt_does(model):
    """A draft model's catch-up on a long prompt goes through decode_tuned; past TUNED_MAX_TOKENS it
    is decode()'s work (all threads), whatever arm the launch tuner is on — the same logits."""
    from kvchat.runtime.context import TUNED_MAX_TOKENS

    ctx, ref = context(model), context(model)
    seen = []
    plain = ctx.decode
    ctx.decode = lambda b: seen.append(b.n_tokens) or plain(b)
    ctx.launch.arm = SERIAL
    long = (PROMPT * 3)[: TUNED_MAX_TOKENS + 1]
    got = decode_tokens(ctx, long, 0, logits="all", tuned=True)
    assert seen == [len(long)]
    np.testing.assert_array_equal(got, decode_tokens(ref, long, 0, logits="all"))
    decode_tokens(ctx, PROMPT[:4], len(long), tuned=True)  # a verify-sized batch: the tuner's arm
    assert seen == [len(long)]


def test_a_self_drafts_importances_are_the_mean_squares_of_each_matrixs_inputs(reference_dir):
    """activation_importance on llama: layer 0's Q, K and V (one fused matrix) share one input,
    RMSNorm(embedding) * attn_norm of the calibration text's tokens; its mean square per column."""
    from kvchat.kernels.norm import rms_norm
    from kvchat.runtime.speculative.importance import CALIBRATION_TEXT, activation_importance

    m = Model.load(reference_dir / "tiny" / "llama3rope_s1.gguf")
    imp = activation_importance(m)
    schema = m.arch.tensors(m.hparams)
    matrices = [t.name for spec in schema.layers for t in spec.values() if len(t.shape) == 2]
    assert sorted(imp) == sorted(n for n in matrices if n in m.gguf.tensors)
    ids = np.array(m.vocab.tokenize(CALIBRATION_TEXT, add_special=False), np.int32)
    h = rms_norm(m.weights.tok_embd.get_rows(ids), m.weights.layers[0].attn_norm, m.hparams.norm_eps)
    want = (h.astype(np.float64) ** 2).mean(axis=0)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(imp[name], want, rtol=1e-5)
    assert imp["blk.1.ffn_down.weight"].shape == (m.hparams.n_ff,) and (imp["blk.1.ffn_down.weight"] > 0).all()
    m.close()


def test_a_model_draft_stops_at_a_token_it_gives_less_than_p_min(model):
    from kvchat.runtime.speculative import make_speculator
    from kvchat.runtime.speculative.draft_model import confident_greedy

    row = np.full(10, -np.inf, np.float32)
    row[[2, 7]] = [np.log(3.0), 0.0]  # p = 0.75 / 0.25
    assert confident_greedy(row, 0.74) == (2, True) and confident_greedy(row, 0.76) == (2, False)
    assert confident_greedy(row, 0.0) == (2, True)
    answers, drafted, verified = {}, {}, {}
    for p_min in (0.0, 0.6, 1.0):
        conv = conversation(model, n_predict=40)
        conv.speculative = make_speculator(conv.ctx, "self:q4_0", draft_max=4, draft_p_min=p_min)
        conv.speculative.length.next = lambda: 4  # every step drafts: what p_min leaves of a draft is under test
        conv.ask("one two three one two three one two three four")
        st = conv.speculative.stats
        answers[p_min], drafted[p_min], verified[p_min] = conv.tokens, st.n_drafted, st.n_verify
    assert answers[0.6] == answers[0.0] == answers[1.0]
    # a SelfDraft (self_draft.py) proposes the unsure token, then stops
    assert type(conv.speculative.source).__name__ == "SelfDraft"
    assert drafted[1.0] == verified[1.0] > 0 and drafted[1.0] <= drafted[0.6] <= drafted[0.0]


def test_empty_proposals_count_as_a_draft_step_spent_for_one_token():
    """q, the share of proposals that drafted something, weighs the draft length's rate: with
    drafts accepted 90 % of the time a half-step draft pays while every proposal drafts, and not when
    nine in ten are empty (each then costs a draft step before the plain one)."""

    def length(empty_share):
        dl = DraftLength(draft_max=8)
        for n in (1, 2, 3, 4, 5, 9):
            for _ in range(4):
                dl.record_decode(n, 0.010 * (1 + 0.08 * (n - 1)))
        for i in range(40):
            if i % 10 < 10 * empty_share:
                dl.record_draft(0, 0, False, 0.005, n_steps=1)
            else:
                dl.record_draft(3, 3 if i % 10 else 2, i % 10 == 0, 0.015, n_steps=3)
        return dl

    full, mostly_empty = length(0.0), length(0.9)
    assert full.q > 0.99 and full.next() >= 3
    assert mostly_empty.q < 0.2 and mostly_empty.next() == 0
    assert abs(mostly_empty.p - full.p) < 0.1  # empty proposals leave the acceptance alone


def _self_draft(ctx, draft_model=None, p_min=0.0):
    """A SelfDraft on ctx's memory; draft_model None: the target itself (its drafts are then the
    target's own greedy tokens, bit for bit: batch-invariant kernels)."""
    from kvchat.runtime.speculative.self_draft import SelfDraft

    return SelfDraft(Context(draft_model or ctx.model, ctx.params, memory=ctx.memory), p_min=p_min)


def test_a_self_draft_in_the_targets_memory_drafts_the_targets_tokens_and_leaves_it_as_plain_decoding(model):
    """With the target as its own 'copy' every draft must be the plain answer's next token (right
    positions, the target's rows read, the draft's own rows gone before the verify writes its),
    all accepted, and the memory ends as plain decoding leaves it (dense; iSWA's window; a
    recurrent or hybrid state checkpointed and restored around the drafts)."""
    plain, stop, n_dec, state, _ = run(model, n=60)
    ctx = context(model)
    spec = Speculator(_self_draft(ctx), draft_max=5)
    spec.length.next = lambda: 5
    gen = generate_speculative(ctx, greedy, spec, prompt=PROMPT, max_tokens=60)
    toks = [s.token for s in gen]
    assert toks == plain and (gen.stop, gen.n_decoded) == (stop, n_dec)
    assert ctx.state_seq_get_data(0) == state
    assert gen.stats.n_drafted >= 5 * (gen.stats.n_verify - 1) and gen.stats.n_accepted == gen.stats.n_drafted


def test_a_self_draft_proposal_leaves_the_memory_as_it_was_when_interrupted_or_out_of_room(model):
    from kvchat.runtime.generate import Interrupted

    ctx = context(model, n_ctx=256)
    decode_tokens(ctx, PROMPT[:-1], 0, logits="none")
    pos = len(PROMPT) - 1
    before = ctx.state_seq_get_data(0)
    src = _self_draft(ctx)
    calls = []
    src.ctx.abort_callback = lambda: calls.append(1) or len(calls) > 2  # the third step aborts
    with pytest.raises(Interrupted):
        src.propose(PROMPT, 5, pos, 0)
    assert ctx.state_seq_get_data(0) == before and ctx.memory.seq_pos_max(0) == pos - 1
    src.ctx.abort_callback = None
    assert len(src.propose(PROMPT, 5, pos, 0)) == 5 and src.step_times[0] == 5
    assert ctx.state_seq_get_data(0) == before
    # three cells left: the steps that found a cell, then the proposal stops (a recurrent memory
    # holds a state, not cells: all 8 steps)
    long = (PROMPT * 20)[:254]
    decode_tokens(ctx, long[pos:-1], pos, logits="none")
    full = ctx.state_seq_get_data(0)
    d = src.propose(long, 8, 253, 0)
    assert len(d) == (8 if type(ctx.memory).__name__ == "MemoryRecurrent" else 3)  # steps at 253, 254, 255
    assert ctx.state_seq_get_data(0) == full


def test_a_self_draft_proposes_the_first_unsure_token_and_stops_there(model):
    """--draft-p-min for a draft in the target's cache: the token under p_min ends the proposal but
    is proposed (its step is paid; a verify row costs little); p_min 1 proposes one token a time."""
    ctx = context(model)
    decode_tokens(ctx, PROMPT[:-1], 0, logits="none")
    pos = len(PROMPT) - 1
    free = _self_draft(ctx).propose(PROMPT, 6, pos, 0)
    assert len(free) == 6
    one = _self_draft(ctx, p_min=1.0).propose(PROMPT, 6, pos, 0)
    assert one == free[:1]


def test_a_self_draft_with_p_min_is_asked_for_draft_max_whenever_drafting_pays(model):
    """It ends its proposals at its first unsure token, so DraftLength's k (from the mean
    acceptance) only says whether to draft: the proposal may run to --draft-max; without p_min,
    k stays the cap."""
    for p_min, want in ((0.5, 6), (0.0, 2)):
        ctx = context(model)
        src = _self_draft(ctx, p_min=p_min)
        asked = []
        propose = src.propose
        src.propose = lambda h, n, pos=None, seq=0: asked.append(n) or propose(h, n, pos, seq)
        spec = Speculator(src, draft_max=6)
        ks = iter([2, 0] * 20)
        spec.length.next = lambda: next(ks)
        toks = [s.token for s in generate_speculative(ctx, greedy, spec, prompt=PROMPT, max_tokens=30)]
        assert toks == run(model, n=30)[0]
        assert asked[:3] == [want] * 3 and max(asked) == want, (p_min, asked)  # the last ones: the token limit


def test_one_stalled_verify_of_a_large_batch_does_not_make_drafts_look_dear():
    """The batch-cost line is Theil-Sen: a 17-token verify timed once at 4x (a stall) leaves the
    estimates of the sizes around it, and drafting goes on."""
    dl = DraftLength(draft_max=16)
    for n in (1, 2, 3, 4, 5):
        for _ in range(4):
            dl.record_decode(n, 0.0144 + 0.001 * (n - 1))
    for _ in range(4):
        dl.record_draft(4, 4, False, 4 * 0.0045)
    k = dl.next()
    dl.record_decode(17, 1.0)  # a size's first decode: not a sample
    dl.record_decode(17, 4 * (0.0144 + 0.016))
    assert dl.next() == k >= 4
    t = dl._line()
    assert abs(t(3) - 0.0164) < 1e-4 and abs(t(1) - 0.0144) < 1e-4


def test_a_self_drafts_warm_up_leaves_a_resumed_sequence_as_it_was(model):
    """Chat warms the draft's kernels up before the first answer (cli/chat/setup.py), maybe after a
    session put cells in the cache: one step past the sequence's end, then removed."""
    ctx = context(model)
    decode_tokens(ctx, PROMPT, 0, logits="none")
    before = ctx.state_seq_get_data(0)
    src = _self_draft(ctx)
    steps = []
    decode = src.ctx.decode_one
    src.ctx.decode_one = lambda t, pos, seq: steps.append(pos) or decode(t, pos, seq)
    src.warm_up(1)
    assert steps == [len(PROMPT)] and ctx.state_seq_get_data(0) == before


def test_a_draft_file_of_the_targets_shape_drafts_in_its_memory_and_another_in_its_own(model, reference_dir):
    """-md with the target's own file (equal hyper-parameters: as another quantization of the same
    model) works in the target's memory — its drafts are the target's tokens, all accepted; a draft
    of another shape (another tiny architecture, same vocabulary) gets a memory of its own."""
    from kvchat.runtime.speculative import make_speculator
    from kvchat.runtime.speculative.self_draft import same_shape

    path = model.path
    other = reference_dir / "tiny" / ("gemma2_s1.gguf" if path.stem != "gemma2_s1" else "llama3rope_s1.gguf")
    plain = run(model, n=30)[0]
    for draft_path, kind in ((path, "SelfDraft"), (other, "ModelDraft")):
        ctx = context(model)
        spec = make_speculator(ctx, "draft", draft_path=draft_path, draft_max=4, draft_p_min=0.0)
        assert type(spec.source).__name__ == kind
        assert same_shape(spec.source.ctx.model, model) == (kind == "SelfDraft")
        spec.length.next = lambda: 4
        gen = generate_speculative(ctx, greedy, spec, prompt=PROMPT, max_tokens=30)
        assert [s.token for s in gen] == plain
        if kind == "SelfDraft":
            assert gen.stats.n_drafted > 0 and gen.stats.n_accepted == gen.stats.n_drafted
        spec.close()
