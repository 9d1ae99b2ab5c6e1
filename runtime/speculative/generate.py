"""The generation loop with speculative decoding: sample, draft, verify in one batch, keep the
accepted run, remove the rest from the memory.

Each step samples the next token t as `generate` does, asks the draft source for up to k tokens
d0..dk-1 (k from DraftLength), and decodes [t, d0, ..., dk-1] in one batch with every row
output. Row i holds the target's logits after t, d0..di-1, bit for bit what a one-token decode
would have given (the kernels are batch-invariant: tests/test_speculative.py checks it), so the
sampler draws from row i exactly as plain decoding would: di is accepted while the drawn token
equals it; the first token drawn that differs is the next sampled token (no draw is wasted or
repeated), and after k accepted drafts row k gives the next one. With greedy sampling the
answer is the plain answer token for token; with a temperature, drafts are deterministic (q a
point mass at di), so the standard speculative-sampling rule — accept with min(1, p(di)/q(di))
= p(di), else draw from p without di — is exactly "draw from p and compare": the output keeps
the target's distribution, and a seeded run draws the same numbers as without drafts, so it
gives the same answer (llama.cpp's common_sampler_sample_and_accept_n works the same way).

Rejected drafts leave the memory through seq_rm; a memory that cannot cut a sequence
(recurrent, hybrid) is restored to a checkpoint taken before the batch and the kept tokens are
decoded again. The memory then holds exactly what plain decoding would have left, also when the
answer stops inside a verified run (end of generation, token limit, Ctrl-C): yielded tokens are
kept as plain decoding keeps them. Drafts never make the sequence need a context shift: k is
capped by the room left, and at the edge a plain step runs (make_room as usual).
"""

from __future__ import annotations

import time

import numpy as np

from kvchat.runtime.generate import DecodeError, Generation, Interrupted, Step, StopReason, decode_tokens, generate
from kvchat.runtime.speculative.speculator import SpecStats


class SpecGeneration(Generation):
    """Generation (runtime/generate.py) with a Speculator's drafts verified in batches.
    history: the sequence's tokens before the answer (what the draft source reads)."""

    def __init__(self, *args, speculator, history=()):
        super().__init__(*args)
        self.spec = speculator
        self.history = [int(t) for t in history]
        self.stats = SpecStats()  # this generation's counts (also added to speculator.stats)

    def _room(self) -> int:
        n_ctx = int(getattr(self.ctx, "n_ctx_seq", 0) or self.ctx.n_ctx)
        return n_ctx - self.pos - 1

    def _steps(self):
        pending = None  # a token drawn from a verify row: the next one, drawn already
        while True:
            if 0 <= self.max_tokens <= self.n_sampled:
                return StopReason.LIMIT
            if self.stop_event is not None and self.stop_event.is_set():
                return StopReason.INTERRUPTED
            pos = self.make_room(self.pos, 1)
            if pos is None:
                return StopReason.CTX_FULL
            self.pos = pos
            token = int(self.sample(self.logits)) if pending is None else pending
            pending = None
            if self.is_eog is not None and self.is_eog(token):
                return StopReason.EOG
            self.n_sampled += 1
            yield Step(token, self.logits, self.n_sampled - 1)
            self.history.append(token)
            if 0 <= self.max_tokens <= self.n_sampled:
                return StopReason.LIMIT
            k = self._draft_budget()
            drafts, t_draft = [], (0, 0.0)
            if k > 0:
                t0 = time.perf_counter()
                try:
                    drafts = [int(d) for d in self.spec.source.propose(self.history, k, self.pos, self.seq)][:k]
                except Interrupted:  # Ctrl-C inside the draft model's decode: the plain step stops too
                    drafts = []
                # (draft steps, their seconds): a model draft times its own one-token decodes; a
                # lookup (n-gram) costs its whole call, one step per drafted token
                t_draft = getattr(self.spec.source, "step_times", None) or (len(drafts), time.perf_counter() - t0)
            if not drafts:
                if k > 0 and t_draft[0]:  # a model draft's steps that proposed nothing (below --draft-p-min)
                    self.spec.length.record_draft(0, 0, False, t_draft[1], n_steps=t_draft[0])
                stop = self._plain(token)
                if stop is not None:
                    return stop
                continue
            outcome = yield from self._verify(token, drafts, t_draft)
            if isinstance(outcome, StopReason):
                return outcome
            pending = outcome

    def _draft_budget(self) -> int:
        """Most drafts this step: DraftLength's choice (draft_max whenever it is not 0 for a source
        that ends its proposals itself) within the token limit and the room left; none when a stop
        was asked for (plain decoding would decode just this token)."""
        if self.stop_event is not None and self.stop_event.is_set():
            return 0
        k = self.spec.length.next()
        if k and getattr(self.spec.source, "ends_unsure", False):
            k = self.spec.length.draft_max  # it ends a proposal at its first unsure token (self_draft.py)
        k = min(k, self._room())
        if self.max_tokens >= 0:
            k = min(k, self.max_tokens - self.n_sampled)
        return max(0, k)

    def _plain(self, token: int):
        """One-token decode of the sampled token (as Generation does: Context.decode_one); a
        StopReason or None."""
        t0 = time.perf_counter()
        try:
            self.logits = self._decode(token)
        except Interrupted:
            return StopReason.INTERRUPTED
        self.spec.length.record_decode(1, time.perf_counter() - t0)
        self.pos += 1
        self.n_decoded += 1
        if self.on_decoded is not None:
            self.on_decoded(token, self.logits)
        return None

    def _verify(self, token: int, drafts: list[int], t_draft: tuple):
        """Decode [token] + drafts, yield the accepted drafts; returns the next token (drawn
        from a row already) or a StopReason."""
        batch = [token] + drafts
        mem = self.ctx.memory
        ckpt = None if mem.get_can_trim() else mem.seq_checkpoint(self.seq)
        t0 = time.perf_counter()
        try:
            rows = decode_tokens(
                self.ctx, batch, self.pos, self.seq, logits="all", batch_factory=self.batch_factory, tuned=True
            )  # [k + 1, n_vocab], a copy
        except Interrupted:
            return StopReason.INTERRUPTED  # the Context rolled the batch back: token not decoded
        except DecodeError as e:
            if e.n_done or e.code != 1:
                raise
            return self._plain(token)  # no room for the drafts (other sequences): plain step
        self.spec.length.record_decode(len(batch), time.perf_counter() - t0)
        st = self.stats
        st.n_verify += 1
        st.n_drafted += len(drafts)
        self._keep_decoded(token, rows[0])
        kept = 1  # batch tokens that stay in memory
        result = None
        for i, d in enumerate(drafts):
            if 0 <= self.max_tokens <= self.n_sampled:
                result = StopReason.LIMIT
                break
            if self.stop_event is not None and self.stop_event.is_set():
                result = StopReason.INTERRUPTED
                break
            self.logits = rows[i]
            s = int(self.sample(rows[i]))
            if s != d:
                result = s
                break
            st.n_accepted += 1
            if self.is_eog is not None and self.is_eog(s):
                result = StopReason.EOG
                break
            self.n_sampled += 1
            yield Step(s, rows[i], self.n_sampled - 1)
            self.history.append(s)
            if 0 <= self.max_tokens <= self.n_sampled:
                result = StopReason.LIMIT  # plain decoding never decodes the last token
                break
            if self.stop_event is not None and self.stop_event.is_set():
                abort = getattr(self.ctx, "abort_callback", None)
                if abort is not None and abort():  # its decode would have been aborted
                    result = StopReason.INTERRUPTED
                    break
                self._keep_decoded(s, rows[i + 1])
                kept += 1
                result = StopReason.INTERRUPTED
                break
            self._keep_decoded(s, rows[i + 1])
            kept += 1
        else:
            self.logits = rows[len(drafts)]
        rejected = isinstance(result, int) and not isinstance(result, StopReason)
        self.spec.length.record_draft(len(drafts), kept - 1, rejected, t_draft[1], n_steps=t_draft[0])
        self._trim(batch, kept, ckpt)
        self.pos += kept
        self.n_decoded += kept
        return result

    def _keep_decoded(self, token: int, row: np.ndarray) -> None:
        if self.on_decoded is not None:
            self.on_decoded(token, row)

    def _trim(self, batch: list[int], kept: int, ckpt) -> None:
        """Make the memory hold batch[:kept] after self.pos (the rest was rejected)."""
        if kept >= len(batch):
            return
        mem = self.ctx.memory
        if ckpt is None:
            if not mem.seq_rm(self.seq, self.pos + kept, -1):
                raise RuntimeError("speculative decoding: the memory refused to remove rejected drafts")
            return
        if not mem.seq_restore(self.seq, ckpt):
            raise RuntimeError("speculative decoding: the memory refused its checkpoint")
        abort, self.ctx.abort_callback = self.ctx.abort_callback, None  # short, and must complete
        try:
            decode_tokens(
                self.ctx, batch[:kept], self.pos, self.seq, logits="none", batch_factory=self.batch_factory, tuned=True
            )
        finally:
            self.ctx.abort_callback = abort

    def __iter__(self):
        try:
            yield from super().__iter__()
        finally:
            self.spec.stats.add(self.stats)


def generate_speculative(ctx, sample, speculator, *, history=(), **kwargs) -> SpecGeneration:
    """generate() (runtime/generate.py, same keywords) with speculator's drafts verified in batches;
    history: the sequence's tokens before the answer, which the draft source reads (a `prompt`
    given here is decoded first and added to it). Tokens and memory are plain decoding's."""
    plain = generate(ctx, sample, **kwargs)
    g = plain
    return SpecGeneration(
        g.ctx,
        g.sample,
        g.logits,
        g.pos,
        g.seq,
        g.max_tokens,
        g.is_eog,
        g.stop_event,
        None if g.make_room == g._fits else g.make_room,
        g.on_decoded,
        g.batch_factory,
        speculator=speculator,
        history=list(history) + list(kwargs.get("prompt", ())),
    )
