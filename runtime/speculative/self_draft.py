"""A draft that works in its target's memory: `--spec-type self:TYPE`, or `-md` with a file of the
target's exact shape (another quantization of the same model).

The TYPE copy of the target's weights (self_quant.py) has the target's hyper-parameters, so its
layers read and write cache rows of the target's shape. Instead of a memory of its own, kept in
step by decoding every accepted token a second time (draft_model.ModelDraft), it drafts in the
target's memory: the past it attends to is the target's exact K/V, and only the tokens it drafts
get rows of its own, which it removes again before the target verifies them. Measured on SmolLM2
F16 (`docs/performance.md`, session 18): teacher-forced agreement with the target 0.877 -> 0.917
(a story), 0.940 -> 0.983 (copying a file), and a proposal of k drafts costs k draft steps — no
catch-up of accepted tokens, no draft prefill of a prompt.

A proposal after token t at position pos of sequence seq (t sampled, not yet decoded):
decode t at pos with the draft's weights -> d1; d1 at pos + 1 -> d2; ... each step one row in the
shared cache; then seq_rm(seq, pos, -1) takes the draft's rows out (also when a step fails or is
interrupted), so the memory holds exactly what it held before, and the verify batch [t, d1..dk]
writes the target's own rows there. A memory that cannot cut a sequence (recurrent, hybrid: the
state is updated in place) is checkpointed before the first step and restored after the last, as
the verify itself does; the draft then also starts from the target's exact recurrent state.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvchat.runtime.generate import DecodeError, Interrupted, decode_one
from kvchat.runtime.speculative.draft_model import confident_greedy
from kvchat.runtime.speculative.speculator import PROBE_EVERY


def same_shape(draft_model, target_model) -> bool:
    """Whether a draft model can work in the target's memory: the same architecture and every
    hyper-parameter equal (the self:TYPE copy shares the target's; a -md file of another
    quantization of the same model has equal ones), so its layers read and write the target's
    cells and rows as the target's own do."""
    a, b = draft_model.hparams, target_model.hparams
    if a is b:
        return True
    if type(a) is not type(b) or draft_model.arch is not target_model.arch:
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if x is None or y is None or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


class SelfDraft:
    """Draft source on a Context of the target's quantized copy (or of a draft model of its
    shape, same_shape) that shares the target's memory (Context(copy, params,
    memory=target_ctx.memory)). p_min (--draft-p-min): a proposal ends with the first token the
    draft gives less probability — that token still proposed: unlike ModelDraft's, whose steps
    decode accepted tokens it needs anyway, a step here serves only its draft, and dropping its
    token wasted it (SmolLM2 F16 story: 1.31x plain dropping it at 0.5, 1.52x proposing it; 1.58x
    drafting up to --draft-max while sure: docs/performance.md, session 18)."""

    def __init__(self, ctx, name: str = "self", n_vocab_target: int | None = None, p_min: float = 0.0):
        self.ctx = ctx
        self.n_vocab_target = n_vocab_target or int(ctx.n_vocab)  # drafts past it are dropped
        self.p_min = float(p_min)
        # with p_min a proposal ends at the draft's first unsure token: when drafting pays at all,
        # it is given --draft-max (a cap from the mean acceptance cut 114 of 164 proposals short)
        self.ends_unsure = self.p_min > 0.0
        self.name = name
        self.step_times = (0, 0.0)  # of the last proposal: (draft steps, their seconds)
        # a probe costs its two draft steps only (no catch-up; ~10 ms on SmolLM2 F16 against 16 plain
        # steps of ~14 ms): DraftLength probes every PROBE_EVERY plain steps, not backing off
        self.probe_max = PROBE_EVERY
        self._n_added = 0  # history tokens already given a row of a self-draft's head (draft_head.py)

    def propose(self, history, n_max: int, pos: int | None = None, seq: int = 0) -> list[int]:
        """Up to n_max greedy draft tokens to follow `history`, whose last token is at `pos` of
        sequence `seq` in the shared memory and not decoded yet (SpecGeneration's state). The
        memory is left as it was."""
        self.step_times = (0, 0.0)
        if n_max <= 0 or not len(history) or pos is None:
            return []
        self._add_head_rows(history)
        mem = self.ctx.memory
        # a recurrent or hybrid memory cannot cut its state: saved here, restored below
        ckpt = None if mem.get_can_trim() else mem.seq_checkpoint(seq)
        out: list[int] = []
        n_steps, seconds = 0, 0.0
        token = int(history[-1])
        try:
            while True:
                t0 = time.perf_counter()
                logits = decode_one(self.ctx, token, pos + len(out), seq)
                seconds += time.perf_counter() - t0
                n_steps += 1
                token, confident = confident_greedy(logits, self.p_min)
                if token >= self.n_vocab_target:
                    break
                out.append(token)  # also when unsure: its step is paid, its verify row costs little
                if len(out) >= n_max or not confident:
                    break
        except DecodeError:
            pass  # no room for another row (other sequences hold the cache): what was drafted
        finally:
            self.step_times = (n_steps, seconds)
            if not (mem.seq_rm(seq, pos, -1) if ckpt is None else mem.seq_restore(seq, ckpt)):
                raise RuntimeError("self-draft: the memory refused to drop the draft's rows")
        return out

    def _add_head_rows(self, history) -> None:
        """Give the conversation's new tokens rows of the copy's head (draft_head.DraftHead)."""
        add_tokens = getattr(self.ctx.model.weights.output, "add_tokens", None)
        if add_tokens is None:
            return
        start = self._n_added if self._n_added <= len(history) else 0
        add_tokens([int(t) for t in history[start:]])
        self._n_added = len(history)

    def warm_up(self, token: int, seq: int = 0) -> None:
        """One draft step past the end of `seq`, removed again: the draft's kernels load (or
        compile) here rather than in the first answer; the memory is left as it was."""
        pos = self.ctx.memory.seq_pos_max(seq) + 1
        if pos >= self.ctx.n_ctx_seq:
            return
        try:
            self.propose([token], 1, pos, seq)
        except Interrupted:
            pass  # an interrupted warm-up costs only the compile it would have saved

    def close(self) -> None:
        """Nothing to release: the draft holds no rows between proposals."""
