"""The token mirror of one sequence's cache, and every edit of it (base of Conversation).

`tokens` is the conversation as tokens *as if nothing had ever been dropped*; context shifts
remove one contiguous run `tokens[n_keep_shift : n_keep_shift + n_dropped]` from the cache, so
the cache holds `tokens[:n_keep_shift] + tokens[n_keep_shift + n_dropped:]` at positions 0, 1, 2...
Every edit here checks what the memory did: `seq_rm` may refuse a partial removal (a recurrent
state) — then the latest checkpoint at or before the cut is restored (runtime/chat/checkpoints.py) or
the sequence is emptied — and a sliding window may no longer hold the cells a kept prefix needs.

The subclass provides `n_keep()` (how many leading tokens a shift keeps), `config.context_shift`,
`notify(event)`, and sets ctx, seq_id, tokens, n_dropped, n_keep_shift, logits, _regen,
checkpoints and _batch in its __init__.
"""

from __future__ import annotations

from kvchat.runtime.chat.events import ContextShifted
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.generate import DecodeError, Interrupted, decode_tokens


class CachedSequence:
    """One sequence of a Context and the token list that mirrors it."""

    @property
    def n_ctx(self) -> int:
        return int(self.ctx.n_ctx)

    @property
    def n_cached(self) -> int:
        """Tokens of this conversation held in the cache."""
        return len(self.tokens) - self.n_dropped

    def cached_tokens(self) -> list[int]:
        if not self.n_dropped:
            return list(self.tokens)
        return self.tokens[: self.n_keep_shift] + self.tokens[self.n_keep_shift + self.n_dropped :]

    def _recent(self, n: int) -> list[int]:
        if n < 0:
            return self.cached_tokens()
        if n <= self.n_cached - self.n_keep_shift or not self.n_dropped:
            return self.tokens[-n:] if n else []
        return self.cached_tokens()[-n:]

    # ---- cache edits -------------------------------------------------------------------------

    def _rewind(self, p: int) -> int:
        """Keep tokens[:p] (indices of the undropped list), remove the rest from the cache.

        Returns the index of `tokens` from which the caller must decode: p, or 0 when the memory
        could not keep the prefix (a partial `seq_rm` refused, or sliding-window layers that no
        longer hold the cells the next token attends to) and the sequence was emptied instead.
        """
        if self.n_dropped and p < self.n_keep_shift + self.n_dropped:
            # the prefix runs into the dropped part: keep what is still cached (the first
            # n_keep_shift) and count the common tokens after it as dropped, which they are
            kept = min(p, self.n_keep_shift)
            self.n_keep_shift, self.n_dropped = (kept, p - kept) if p > kept else (0, 0)
        else:
            kept = p - self.n_dropped
        self.tokens = self.tokens[:p]
        self.logits = None
        self._regen = None
        if not self._remove_from(kept):
            n = self.checkpoints.restore(kept) if not self.n_dropped else -1
            if n < 0:
                self._forget_all()
                return 0
            self.tokens = self.tokens[:n]  # decode again from the checkpoint on
            return n
        self.checkpoints.drop_after(kept)
        return p

    def _remove_from(self, kept: int) -> bool:
        """seq_rm of cache positions >= kept; False if the memory cannot serve the kept prefix:
        a refused partial removal (a recurrent state), or sliding-window layers that no longer
        hold the cells the token at `kept` attends to. The caches keep each sequence's positions
        contiguous (pos_min..pos_max all held), so pos_min tells whether that window survives."""
        mem = self.ctx.memory
        if not mem.seq_rm(self.seq_id, kept, -1):
            return False
        if kept == 0:
            return True
        if mem.seq_pos_max(self.seq_id) != kept - 1:
            return False
        n_swa = self._swa_window()
        return not n_swa or mem.seq_pos_min(self.seq_id) <= max(0, kept - n_swa + 1)

    def _swa_window(self) -> int:
        """n_swa when sliding-window layers keep only a window of cells (iSWA without swa_full)."""
        hp, cp = getattr(self.ctx, "hparams", None), getattr(self.ctx, "cparams", None)
        if hp is None or getattr(cp, "swa_full", False) or not any(getattr(hp, "swa_layers", ()) or ()):
            return 0
        return int(getattr(hp, "n_swa", 0) or 0)

    def _forget_all(self) -> None:
        """Empty the sequence and the token mirror (the messages stay)."""
        if not self.ctx.memory.seq_rm(self.seq_id, -1, -1):
            raise KvchatError("the memory refused to clear the conversation's sequence")
        self.tokens = []
        self.n_dropped = 0
        self.n_keep_shift = 0
        self.logits = None
        self._regen = None
        self.checkpoints.clear()

    def context_shift(self, n_needed: int = 1) -> int:
        """Drop half of the tokens after n_keep (repeatedly) until n_needed more fit. Returns the count."""
        n_keep = self.n_keep_shift if self.n_dropped else min(self.n_keep(), self.n_cached)
        total = 0
        mem = self.ctx.memory
        while self.n_cached + n_needed > self.n_ctx:
            n_left = self.n_cached - n_keep
            if n_left <= 0:
                break
            n_discard = max(1, n_left // 2)
            if not mem.seq_rm(self.seq_id, n_keep, n_keep + n_discard):
                break  # this memory cannot drop a middle run: the caller stops instead
            mem.seq_add(self.seq_id, n_keep + n_discard, self.n_cached, -n_discard)
            self.n_keep_shift = n_keep
            self.n_dropped += n_discard
            total += n_discard
        if total:
            self.notify(ContextShifted(total, n_keep))
        return total

    def _can_shift(self) -> bool:
        mem = self.ctx.memory
        can = getattr(mem, "get_can_shift", None)
        return (
            self.config.context_shift and (can() if callable(can) else True) and not self.checkpoints.needed
        )  # a shift removes a middle run

    def _decode(self, ids: list[int]) -> None:
        """Decode ids at the end of the cache; the mirror follows what reached memory."""
        try:
            self.logits = decode_tokens(self.ctx, ids, self.n_cached, self.seq_id, batch_factory=self._batch)
        except (Interrupted, DecodeError) as e:
            self.tokens.extend(int(t) for t in ids[: e.n_done])
            self.logits = None
            raise
        self.tokens.extend(int(t) for t in ids)

    def repair(self) -> None:
        """After an exception escaped mid-decode: drop any cell beyond the tokens we track."""
        if not self._remove_from(self.n_cached):
            self._forget_all()
