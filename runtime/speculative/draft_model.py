"""Drafts from a model: a smaller model of the same vocabulary (`-md FILE`), or the target's own
weights quantized at load (`self:q4_0`, runtime/speculative/self_quant.py).

The draft model has its own Context and memory. It is kept in step with the target the way
llama.cpp's common_speculative does: each proposal receives the sequence so far, keeps the
longest prefix its cache already holds (seq_rm of the rest: the drafts the target rejected, or
what a context shift of the target changed), decodes the new tokens in one batch, then drafts
greedily, one token at a time. A recurrent or hybrid draft cannot cut its drafts off: it keeps a
checkpoint of its state before drafting and restores it (llama.cpp's speculative-simple does the
same with its draft context). A sequence longer than the draft's context is windowed: the draft
sees its tail from a start that moves in steps of half its context, so the prefix stays reusable
between proposals.
"""

from __future__ import annotations

import time

import numpy as np

from kvchat.runtime.chat.refit import common_prefix
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.generate import decode_one, decode_tokens

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE (padded vocabularies)


def check_same_vocab(target_vocab, draft_vocab, draft_name: str) -> None:
    """KvchatError (one line) unless the draft's token ids mean what the target's mean (llama.cpp's
    common_speculative_are_compatible: sizes within 128, the same texts over the shared ids, the
    same BOS/EOS): a draft from another vocabulary would be accepted never, or by accident."""
    nt, nd = int(target_vocab.n_vocab), int(draft_vocab.n_vocab)
    why = None
    if abs(nt - nd) > VOCAB_MAX_SIZE_DIFFERENCE:
        why = f"{nd} tokens against the target's {nt}"
    else:
        n = min(nt, nd)
        for i in sorted(set(range(0, n, max(1, n // 4096))) | {n - 1}):
            if target_vocab.token_text(i) != draft_vocab.token_text(i):
                why = f"token {i} is {draft_vocab.token_text(i)!r}, the target's {target_vocab.token_text(i)!r}"
                break
    if why is None and (target_vocab.bos, target_vocab.eos) != (draft_vocab.bos, draft_vocab.eos):
        why = "its BOS/EOS tokens differ"
    if why is not None:
        raise KvchatError(
            f"draft model {draft_name}: not the target's vocabulary ({why}); use a model of the same family"
        )


def confident_greedy(logits: np.ndarray, p_min: float) -> tuple[int, bool]:
    """(the greedy token of a logit row, whether its softmax probability is at least p_min).
    Terms more than 20 nats below the max (< 2e-9 each) are left out of the sum: a draft head's
    -inf rows and the long tail cost no exp (~90 us for Gemma-3's 262144 logits)."""
    t = int(np.argmax(logits))  # ties to the lowest id, as the sampler's greedy
    if p_min <= 0.0:
        return t, True
    m = logits[t]
    close = logits[logits > m - np.float32(20.0)]
    return t, float(np.exp(close - m).sum()) * p_min <= 1.0


class ModelDraft:
    """Draft source on a draft model's Context (sequence 0). p_min: a proposal stops before a
    token the draft gives less probability than this (llama.cpp's --draft-p-min): such tokens are
    rejected about half the time, and each costs a draft step and a verify row."""

    def __init__(self, ctx, name: str = "draft", n_vocab_target: int | None = None, p_min: float = 0.0):
        self.ctx = ctx
        self.n_vocab_target = n_vocab_target or int(ctx.n_vocab)  # drafts past it are dropped
        self.p_min = float(p_min)
        self.name = name
        self.cached: list[int] = []  # the tokens the draft's cache holds, at positions 0, 1, ...
        self.offset = 0  # history index of the draft's position 0 (the window's start)
        self._ckpt = None  # recurrent/hybrid draft: (checkpoint, tokens it holds, logits after them)
        # of the last proposal: (one-token decodes, their seconds) — what a drafted token costs. A
        # catch-up on a backlog (the prompt, the tokens of plain steps) is one batch whose cost per
        # token says nothing about a draft step (SmolLM2: 1.3 ms a token against an 8 ms step)
        self.step_times = (0, 0.0)

    def _window(self, history, n_max: int) -> int:
        """Where the draft's window of history starts (a multiple of half its context)."""
        n_ctx = int(self.ctx.n_ctx_seq)
        need = len(history) + n_max + 1
        if need <= n_ctx:
            return 0
        half = max(1, n_ctx // 2)
        return ((need - n_ctx) // half + 1) * half

    def propose(self, history, n_max: int, pos: int | None = None, seq: int = 0) -> list[int]:
        """Up to n_max greedy draft tokens to follow `history` (token ids, oldest first); pos and
        seq (where the target holds it) do not matter to a draft with its own memory."""
        if n_max <= 0 or not len(history):
            return []
        start = self._window(history, n_max)
        if start >= len(history):
            return []
        h = [int(t) for t in history[start:]]
        if start != self.offset:
            self._forget()
            self.offset = start
        n_new = len(h) - min(common_prefix(self.cached, h), len(h) - 1)  # tokens to decode
        add_tokens = getattr(self.ctx.model.weights.output, "add_tokens", None)
        if add_tokens is not None:  # a self-draft's head (draft_head.py): the conversation's tokens get rows
            add_tokens(h[-n_new:])
        t0 = time.perf_counter()
        logits = self._catch_up(h)
        # a steady step decodes one new token here (the draft's cache holds its accepted drafts):
        # a draft step; a backlog is not
        n_steps, seconds = (1, time.perf_counter() - t0) if n_new == 1 else (0, 0.0)
        out: list[int] = []
        try:
            while True:
                t, confident = confident_greedy(logits, self.p_min)
                if t >= self.n_vocab_target or not confident:
                    return out
                out.append(t)
                if len(out) >= n_max:
                    return out
                t0 = time.perf_counter()
                logits = decode_one(self.ctx, t, len(self.cached), 0)
                seconds += time.perf_counter() - t0
                n_steps += 1
                self.cached.append(t)
        finally:
            self.step_times = (n_steps, seconds)

    def _catch_up(self, h: list[int]) -> np.ndarray:
        """Make the draft's memory hold h (a window of the history) and return the logits after
        its last token, decoding only what it does not hold yet. The draft's decodes run on its
        launch tuner's arm (Context.decode_tuned): under load a parallel launch waits for a
        descheduled worker (a 17-token catch-up through decode() took 2.8 s at load 7)."""
        mem = self.ctx.memory
        if not mem.get_can_trim():
            return self._catch_up_from_checkpoint(h)
        p = common_prefix(self.cached, h)
        if p >= len(h):
            p = len(h) - 1  # re-decode the last token: its logits start the draft
        mem.seq_rm(0, p, -1)
        self.cached = h[:p]
        logits = decode_tokens(self.ctx, h[p:], p, 0, tuned=True)
        self.cached = h
        return logits

    def _catch_up_from_checkpoint(self, h: list[int]) -> np.ndarray:
        """_catch_up for a recurrent or hybrid draft, which cannot cut its own drafts off: the
        state saved before the last drafts (with the logits after it) is restored, the tokens
        since are decoded, and a new checkpoint is taken before drafting again (llama.cpp's
        speculative-simple restores its draft context from a checkpoint the same way)."""
        ck = self._ckpt
        mem = self.ctx.memory
        if ck is not None and len(ck[1]) <= len(h) and h[: len(ck[1])] == ck[1] and mem.seq_restore(0, ck[0]):
            base, logits = ck[1], ck[2]
        else:
            mem.seq_rm(0, -1, -1)
            base, logits = [], None
        self.cached = list(base)
        if len(h) > len(base):
            logits = decode_tokens(self.ctx, h[len(base) :], len(base), 0, tuned=True)
        self.cached = list(h)  # grows with the drafts; the checkpoint's tokens stay h
        self._ckpt = (mem.seq_checkpoint(0), h, logits)
        return logits

    def warm_up(self, token: int) -> None:
        """Load (or compile) the draft's kernels before the first answer (runtime.generate.warm_up)."""
        from kvchat.runtime.generate import warm_up

        warm_up(self.ctx, token)

    def _forget(self) -> None:
        self.ctx.memory.seq_rm(0, -1, -1)
        self.cached = []
        self._ckpt = None

    def close(self) -> None:
        self._forget()
