"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's
last few tokens (llama.cpp's `ngram-simple`, "prompt lookup decoding"). No second model: an
answer that copies from its prompt (a code file rewritten, a quote, a list repeated) gets its
next tokens from there, and an answer that does not gets no drafts, which costs nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDraft:
    """Draft source: the longest suffix of 2..ngram_max tokens (longest first) found earlier in
    the sequence, most recent occurrence first; its continuation is the draft."""

    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, window: int = 8192):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram sizes {ngram_min}..{ngram_max}: need 1 <= min <= max")
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.window = int(window)  # only the last `window` tokens are searched (cost per draft)

    def propose(self, history, n_max: int) -> list[int]:
        """Up to n_max draft tokens to follow `history` (token ids, oldest first)."""
        if n_max <= 0:
            return []
        h = np.asarray(history[-self.window :], dtype=np.int64)  # [n]
        n = int(h.size)
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            key = h[n - size :]  # [size]
            # starts i of earlier occurrences: h[i:i+size] == key, continuation h[i+size] exists
            win = sliding_window_view(h[: n - 1], size)  # [n - size, size]
            hits = np.nonzero((win == key).all(axis=1))[0]
            if hits.size:
                j = int(hits[-1]) + size  # first continuation token
                return [int(t) for t in h[j : min(n, j + n_max)]]
        return []

    def accepted(self, history) -> None:
        """Nothing to keep in step: every draft reads the history it is given."""

    def close(self) -> None:
        pass
