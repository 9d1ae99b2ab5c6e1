"""Conversation logic (incremental prefill, overflow policy, regen/undo, restore) on a fake engine.

The fake context implements the Context contract on a dict of cells {pos: token}. Its "model"
predicts the next token from a position-weighted hash of everything in the cache, so any
mistake in what is cached (a wrong token, a gap, a stale cell) changes the greedy answer, and
decode() refuses a batch whose positions do not continue the sequence.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from kvchat.cli.wording import event_text
from kvchat.runtime.chat.conversation import Conversation, ConversationConfig, Interrupted, PromptTooLong, common_prefix
from kvchat.runtime.errors import KvchatError, SessionError
from kvchat.runtime.sampling import Sampler, SamplingParams

V = 40  # vocabulary: 0 = end of turn, 1..39 = characters


class FakeVocab:
    n_vocab = V
    bos = None
    eos = 0
    eog = {0}
    add_bos = False

    def tokenize(self, text, add_special=True, parse_special=False):
        return [1 + ord(c) % (V - 1) for c in text]

    def is_eog(self, t):
        return t == 0


class FakeDecoder:
    """Inverse of FakeVocab.tokenize on 1..39, so answers re-tokenize to the sampled ids."""

    def __init__(self, vocab):
        pass

    def feed(self, t):
        return chr(2 * (V - 1) + t - 1)

    def flush(self):
        return ""


class FakeTemplate:
    def render(self, messages, add_generation_prompt=True):
        s = "".join(f"[{m['role'][0]}]{m['content']}|" for m in messages)
        return s + ("[a]" if add_generation_prompt else "")


def next_token(cells: dict, eog_at: int | None) -> int:
    toks = [cells[p] for p in sorted(cells)]
    if eog_at is not None and len(toks) % eog_at == 0:
        return 0
    h = sum((i + 1) * t for i, t in enumerate(toks))
    return 1 + h % (V - 1)


class FakeMemory:
    def __init__(self):
        self.cells = {}  # pos -> token (one sequence)

    def seq_rm(self, seq, p0, p1):
        p0 = 0 if p0 < 0 else p0
        p1 = float("inf") if p1 < 0 else p1
        self.cells = {p: t for p, t in self.cells.items() if not (p0 <= p < p1)}
        return True

    def seq_add(self, seq, p0, p1, delta):
        p1 = float("inf") if p1 < 0 else p1
        moved = {}
        for p, t in self.cells.items():
            q = p + delta if p0 <= p < p1 else p
            assert q not in moved, "seq_add made two cells share a position"
            moved[q] = t
        self.cells = moved

    def seq_pos_max(self, seq):
        return max(self.cells) if self.cells else -1

    def tokens(self):
        return [self.cells[p] for p in sorted(self.cells)]


class FakeContext:
    def __init__(self, n_ctx=64, n_batch=16, eog_at=None):
        self.n_ctx = n_ctx
        self.cparams = SimpleNamespace(n_batch=n_batch)
        self.memory = FakeMemory()
        self.eog_at = eog_at
        self.abort_callback = None
        self.n_decoded = 0
        self.n_calls = 0
        self._logits = None

    def decode(self, batch):
        toks, pos0, seq = batch
        self.n_calls += 1
        if pos0 != self.memory.seq_pos_max(seq) + 1:
            return -1  # positions must continue the sequence
        if len(self.memory.cells) + len(toks) > self.n_ctx:
            return 1
        if self.abort_callback and self.abort_callback():
            return 2
        for i, t in enumerate(toks):
            self.memory.cells[pos0 + i] = int(t)
        self.n_decoded += len(toks)
        logits = np.zeros(V, dtype=np.float32)
        logits[next_token(self.memory.cells, self.eog_at)] = 5.0
        self._logits = logits
        return 0

    def get_logits_ith(self, i):
        assert i == -1
        return self._logits

    def state_seq_get_data(self, seq):
        return json.dumps(sorted(self.memory.cells.items())).encode()

    def state_seq_set_data(self, blob, seq):
        try:
            cells = {int(p): int(t) for p, t in json.loads(blob.decode())}
        except Exception:
            return 0
        if len(cells) > self.n_ctx:
            return 0
        self.memory.cells = cells
        return len(blob)


def make(n_ctx=64, system="SYS", eog_at=None, **cfg):
    ctx = FakeContext(n_ctx=n_ctx, eog_at=eog_at)
    notes = []
    conv = Conversation(
        ctx,
        FakeVocab(),
        FakeTemplate(),
        Sampler(SamplingParams(temp=0.0, seed=1)),
        ConversationConfig(system_prompt=system, **cfg),
        notify=lambda event: notes.append(event_text(event)),
        batch_factory=lambda toks, pos0, seq: (list(toks), pos0, seq),
        stream_decoder=FakeDecoder,
    )
    ctx.abort_callback = conv.stop_event.is_set
    return conv, ctx, notes


def tok(text):
    return FakeVocab().tokenize(text)


def expected_answer(cache_tokens, n, eog_at=None):
    """Greedy answer of the fake model given the cache content (no shifting)."""
    cells = {i: t for i, t in enumerate(cache_tokens)}
    out = []
    for _ in range(n):
        t = next_token(cells, eog_at)
        if t == 0:
            break
        out.append(t)
        cells[len(cells)] = t
    return out


def consistent(conv, ctx):
    assert ctx.memory.tokens() == conv.cached_tokens()
    assert sorted(ctx.memory.cells) == list(range(conv.n_cached))  # positions 0..n-1, no gaps


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0


def test_first_turn_then_only_new_tokens():
    conv, ctx, _ = make(n_predict=5)
    s1 = conv.ask("hi")
    prompt1 = tok("[s]SYS|[u]hi|[a]")
    assert s1.n_prompt == len(prompt1) and ctx.n_decoded == len(prompt1) + 4  # last answer token not decoded
    ans1 = expected_answer(prompt1, 5)
    assert conv.messages[-1] == {"role": "assistant", "content": "".join(FakeDecoder(None).feed(t) for t in ans1)}
    assert s1.n_gen == 5 and s1.stop == "limit"
    consistent(conv, ctx)
    assert conv.tokens == prompt1 + ans1[:4]

    before = ctx.n_decoded
    s2 = conv.ask("more")
    full2 = conv.render(conv.messages[:-1])
    # new tokens: the 5th answer token, the closing "|", the new user turn and "[a]"
    assert s2.n_prompt == len(full2) - len(prompt1) - 4
    assert ctx.n_decoded - before == s2.n_prompt + s2.n_gen_decoded
    consistent(conv, ctx)
    assert conv.tokens[: len(full2)] == full2


def test_end_of_turn_stops_answer():
    conv, ctx, _ = make(eog_at=30)
    s = conv.ask("hello")
    assert s.stop == "eog"
    prompt = tok("[s]SYS|[u]hello|[a]")
    assert s.n_gen == 30 - len(prompt)
    consistent(conv, ctx)


def test_regen_samples_again_without_prefill():
    conv, ctx, _ = make(n_predict=6)
    conv.sampler = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    conv.ask("hi")
    calls = ctx.n_calls
    s = conv.regenerate()
    assert s.n_prompt == 0
    assert ctx.n_calls - calls == s.n_gen_decoded  # only answer tokens were decoded
    assert len(conv.messages) == 3 and conv.messages[-1]["role"] == "assistant"
    consistent(conv, ctx)
    prompt = tok("[s]SYS|[u]hi|[a]")
    assert conv.tokens[: len(prompt)] == prompt and len(conv.tokens) == len(prompt) + 5


def test_regen_without_answer_is_an_error():
    conv, _, _ = make()
    with pytest.raises(KvchatError):
        conv.regenerate()


def test_undo_rewinds_cache():
    conv, ctx, _ = make(n_predict=4)
    conv.ask("one")
    n_after_first = conv.n_cached
    conv.ask("two")
    assert conv.undo() == 2
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    consistent(conv, ctx)
    # what remains is exactly the rendering of the remaining messages (it was all cached)
    assert conv.tokens == conv.render(conv.messages, add_generation_prompt=False)
    assert conv.n_cached == n_after_first + 2  # + the last answer token and the closing "|"
    before = ctx.n_decoded
    conv.ask("two")  # same question again: only what undo removed is decoded
    assert ctx.n_decoded - before == conv.last_stats.n_prompt + conv.last_stats.n_gen_decoded
    consistent(conv, ctx)


def test_clear_empties_sequence_keeps_system():
    conv, ctx, _ = make(n_predict=3)
    conv.ask("x")
    conv.clear()
    assert ctx.memory.cells == {} and conv.tokens == []
    assert conv.messages == [{"role": "system", "content": "SYS"}]


def test_n_keep_defaults_to_system_prompt():
    conv, _, _ = make()
    # "[s]SYS|[u]" is common to every first turn; the user's words start after it
    assert conv.n_keep() == len(tok("[s]SYS|[u]"))
    conv.set_system("LONGER SYSTEM")
    assert conv.n_keep() == len(tok("[s]LONGER SYSTEM|[u]"))


def test_context_shift_keeps_prefix_drops_half():
    conv, ctx, notes = make(n_ctx=64, n_predict=120)
    s = conv.ask("hi")
    assert s.stop == "limit" and s.n_gen == 120
    n_keep = len(tok("[s]SYS|[u]"))
    assert conv.n_keep_shift == n_keep and conv.n_dropped > 0
    assert s.n_shifted == conv.n_dropped
    assert notes and all("dropped" in n for n in notes)
    # each shift drops half of what followed n_keep when the cache was full
    first = int(notes[0].split("dropped ")[1].split()[0])
    assert first == (64 - n_keep) // 2
    consistent(conv, ctx)
    assert conv.cached_tokens()[:n_keep] == tok("[s]SYS|[u]")
    # the answer continued from the shifted cache: replay the fake model over the same shifts
    # (a token is sampled from the logits of the last decode, made before any shift)
    prompt = tok("[s]SYS|[u]hi|[a]")
    seq = list(prompt)
    last_decoded = dict(enumerate(seq))
    answer = []
    for _ in range(120):
        if len(seq) + 1 > 64:
            d = (len(seq) - n_keep) // 2
            seq = seq[:n_keep] + seq[n_keep + d :]
        t = next_token(last_decoded, None)
        answer.append(t)
        if len(answer) < 120:
            seq.append(t)
            last_decoded = dict(enumerate(seq))
    assert conv.messages[-1]["content"] == "".join(FakeDecoder(None).feed(t) for t in answer)
    assert conv.cached_tokens() == seq


def test_follow_up_after_shift_decodes_only_new_tokens():
    conv, ctx, _ = make(n_ctx=64, n_predict=80)
    conv.ask("hi")
    assert conv.n_dropped > 0
    conv.config.n_predict = 2
    before = ctx.n_decoded
    s = conv.ask("ok")
    assert s.n_prompt <= len(tok("X|[u]ok|[a]"))
    assert ctx.n_decoded - before == s.n_prompt + s.n_gen_decoded + 0
    consistent(conv, ctx)


def test_no_context_shift_stops_cleanly():
    conv, ctx, notes = make(n_ctx=64, n_predict=200, context_shift=False)
    s = conv.ask("hi")
    assert s.stop == "ctx_full"
    assert conv.n_cached == 64 and conv.n_dropped == 0
    assert any("context full" in n and "stopped" in n for n in notes)
    consistent(conv, ctx)
    # the answer stays in the conversation
    assert conv.messages[-1]["role"] == "assistant" and len(conv.messages[-1]["content"]) == s.n_gen


def test_prompt_longer_than_context_is_refused_with_numbers():
    conv, ctx, _ = make(n_ctx=64, n_predict=2)
    conv.ask("hi")
    msgs, toks, cells = list(conv.messages), list(conv.tokens), dict(ctx.memory.cells)
    desired = conv.render(conv.messages + [{"role": "user", "content": "x" * 100}])
    n_new = len(desired) - common_prefix(conv.tokens, desired)
    with pytest.raises(PromptTooLong) as e:
        conv.ask("x" * 100)
    msg = str(e.value)
    assert f"needs {n_new} new tokens" in msg and f"only {64 - conv.n_keep()} fit" in msg
    assert "context of 64 tokens" in msg
    assert conv.messages == msgs and conv.tokens == toks and ctx.memory.cells == cells


def test_prompt_too_long_without_shift_counts_whole_prompt():
    conv, ctx, _ = make(n_ctx=32, n_predict=1, context_shift=False)
    with pytest.raises(PromptTooLong) as e:
        conv.ask("y" * 40)
    n = len(tok("[s]SYS|[u]" + "y" * 40 + "|[a]"))
    assert f"needs {n} new tokens but only 32 fit" in str(e.value)
    assert ctx.memory.cells == {} and len(conv.messages) == 1


def test_interrupted_prompt_withdraws_message_and_stays_consistent():
    conv, ctx, _ = make(n_ctx=256, n_predict=2)
    ctx.cparams.n_batch = 4
    calls = {"n": 0}

    def abort():
        calls["n"] += 1
        return calls["n"] >= 3  # abort the third chunk

    ctx.abort_callback = abort
    with pytest.raises(Interrupted):
        conv.ask("a long question")
    assert len(conv.messages) == 1
    consistent(conv, ctx)
    assert conv.n_cached == 8  # two chunks of 4 survived
    ctx.abort_callback = conv.stop_event.is_set
    s = conv.ask("a long question")
    assert s.n_prompt == len(tok("[s]SYS|[u]a long question|[a]")) - 8  # the rest only
    consistent(conv, ctx)


def test_stop_event_keeps_partial_answer():
    conv, ctx, _ = make(n_predict=50)
    seen = []

    def on_text(t):
        seen.append(t)
        if len(seen) == 3:
            conv.stop_event.set()

    s = conv.ask("hi", on_text=on_text)
    assert s.stop == "interrupted"
    assert conv.messages[-1]["content"] == "".join(seen) and len(seen) == 3
    consistent(conv, ctx)
    s2 = conv.ask("again")  # the next turn starts normally
    assert s2.stop == "limit"
    consistent(conv, ctx)


def test_ignore_eos_masks_end_of_turn():
    conv, ctx, _ = make(n_ctx=128, eog_at=30, n_predict=20, ignore_eos=True)
    s = conv.ask("hello")
    assert s.n_gen == 20 and s.stop == "limit"


def test_session_state_round_trip_on_fresh_context():
    conv, ctx, _ = make(n_ctx=64, n_predict=80)
    conv.ask("hi")
    st = conv.session_state()
    conv2, ctx2, _ = make(n_ctx=64, n_predict=3)
    conv2.restore(st["messages"], st["tokens"], st["n_dropped"], st["n_keep"], st["state"])
    assert conv2.messages == conv.messages and conv2.tokens == conv.tokens
    consistent(conv2, ctx2)
    s = conv2.ask("next")
    assert s.n_prompt <= len(tok("X|[u]next|[a]"))  # nothing saved is decoded again
    consistent(conv2, ctx2)


def test_restore_refused_leaves_conversation_untouched():
    conv, ctx, _ = make(n_predict=3)
    conv.ask("hi")
    msgs, toks, cells = list(conv.messages), list(conv.tokens), dict(ctx.memory.cells)
    with pytest.raises(SessionError):
        conv.restore([], [1, 2, 3], 0, 0, b"not json")
    assert conv.messages == msgs and conv.tokens == toks and ctx.memory.cells == cells
    # a state whose length disagrees with the token list is refused too, and rolled back
    bad = json.dumps([[0, 5]]).encode()
    with pytest.raises(SessionError):
        conv.restore([], [1, 2, 3], 0, 0, bad)
    assert ctx.memory.cells == cells and conv.tokens == toks


def test_memory_that_cannot_shift_stops_with_reason():
    conv, ctx, notes = make(n_ctx=64, n_predict=200)
    ctx.memory.get_can_shift = lambda: False  # e.g. an iSWA cache without --swa-full
    s = conv.ask("hi")
    assert s.stop == "ctx_full" and conv.n_cached == 64 and conv.n_dropped == 0
    assert any("cannot shift" in n and "--swa-full" in n for n in notes)
    consistent(conv, ctx)


def test_repair_drops_cells_beyond_tracked_tokens():
    conv, ctx, _ = make(n_predict=3)
    conv.ask("hi")
    n = conv.n_cached
    ctx.memory.cells[n] = 7  # a cell placed by a decode that was cut short by an exception
    conv.repair()
    consistent(conv, ctx)
