"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's
last few tokens (llama.cpp's `ngram-simple`, "prompt lookup decoding"). No second model: an
answer that copies from its prompt (a code file rewritten, a quote, a list repeated) gets its
next tokens from there, and an answer that does not gets no drafts, which costs nothing.
"""

from __future__ import annotations

import numpy as np


class NgramDraft:
    """Draft source: the longest suffix of ngram_min..ngram_max tokens found earlier in the
    sequence, its most recent occurrence among the longest; its continuation is the draft.

    A long key (up to 12 tokens, llama.cpp's ngram-simple looks up 12) tells a copied passage from
    a phrase that merely recurs: with keys of at most 4 tokens Gemma-3 270m rewriting a code file
    had 74 % of its drafts accepted, with up to 12 92 % (docs/performance.md)."""

    name = "ngram"

    def __init__(self, ngram_max: int = 12, ngram_min: int = 2, window: int = 8192):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram sizes {ngram_min}..{ngram_max}: need 1 <= min <= max")
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.window = int(window)  # only the last `window` tokens are searched (cost per draft)

    def propose(self, history, n_max: int, pos: int | None = None, seq: int = 0) -> list[int]:
        """Up to n_max draft tokens to follow `history` (token ids, oldest first); pos and seq
        (where the target holds it) do not matter to a lookup."""
        if n_max <= 0:
            return []
        h = np.asarray(history[-self.window :], dtype=np.int64)  # [n]
        n = int(h.size)
        if n < 2:
            return []
        # ends i of earlier occurrences of the last token, each with a continuation h[i + 1]
        ends = np.flatnonzero(h[: n - 1] == h[n - 1])  # [c]
        length = np.ones(ends.size, np.int64)  # how many tokens of the suffix match, ending at i
        alive = np.ones(ends.size, bool)
        for k in range(1, min(self.ngram_max, n - 1)):
            at = ends - k
            alive &= at >= 0
            alive[alive] = h[at[alive]] == h[n - 1 - k]
            length += alive
            if not alive.any():
                break
        if not ends.size or length.max() < self.ngram_min:
            return []
        j = int(ends[length == length.max()][-1]) + 1  # first continuation token
        return [int(t) for t in h[j : min(n, j + n_max)]]

    def accepted(self, history) -> None:
        """Nothing to keep in step: every draft reads the history it is given."""

    def close(self) -> None:
        pass
