"""The lm head of a self-draft (`--spec-type self:TYPE`): the target's output rows in q8_0, for the
first `DRAFT_HEAD_ROWS` token ids and every token the conversation has shown, the others -inf.

Why: a draft only has to name the target's likely next token, and the head decides most of that.
Requantizing the head to 4 bits made SmolLM2's q4_0 draft agree with its F16 target on 0.70 of
greedy tokens, a q8_0 head 0.76 (Gemma-3 270m 0.88 -> 0.95). But the head is a large part of a
small model (SmolLM2 21 % of its weights, Gemma-3 270m 63 %), and a draft step reads all of it: a
whole q8_0 head would make Gemma-3's draft step cost half its target's. Token ids run roughly in
merge order in BPE vocabularies, so the first ids hold the frequent tokens, and a conversation
keeps reusing its own (a renamed identifier, a name in a story); with those rows alone SmolLM2's
agreement moved from 0.76 to 0.745 on a story and not at all on a copy task (docs/performance.md).
A token outside them is never drafted, which costs a rejected draft, never a wrong answer: the
target verifies every draft.

Rows are requantized from the file's (or the target's) output matrix as they join; the seen
tokens past the first ids live in a second, small matrix rebuilt when new ones arrive. A width
that q8_0's 32-value blocks do not divide keeps the file's rows as they are.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.quants import dequantize, quantize

DRAFT_HEAD_ROWS = 16384  # token ids 0 .. DRAFT_HEAD_ROWS - 1 always have a row
HEAD_TYPE = GGMLType.Q8_0


class DraftHead:
    """Model.weights.output of a self-draft: matmul(h) -> [n, n_vocab] logits, -inf for tokens
    without a row. rows(ids) -> u8 [len(ids), row_bytes] of the source head (any ggml type)."""

    def __init__(self, rows, n_vocab: int, k: int, n_base: int = DRAFT_HEAD_ROWS):
        self.m, self.k = int(n_vocab), int(k)
        self._rows = rows
        self._requant = self.k % 32 == 0  # q8_0 blocks hold 32 values
        n_base = min(int(n_base), self.m)
        self._base = self._matrix(np.arange(n_base))
        self.n_base = n_base
        self._extra_ids = np.zeros(0, np.int64)  # ids >= n_base with a row, ascending
        self._extra = None
        self._seen = np.zeros(self.m, bool)
        self._seen[:n_base] = True

    def _matrix(self, ids: np.ndarray) -> QMatrix:
        if not self._requant:
            return QMatrix(self._rows(ids), self._rows.ggml_type, self.k, keep_raw=False)
        x = dequantize(self._rows(ids), self._rows.ggml_type, self.k)  # [len(ids), k] f32
        return QMatrix(quantize(x, int(HEAD_TYPE)), int(HEAD_TYPE), self.k, keep_raw=False)

    def add_tokens(self, ids) -> None:
        """Give the tokens in ids (a conversation's) a row, if they have none yet."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.m)]
        new = np.unique(ids[~self._seen[ids]])
        if not new.size:
            return
        self._seen[new] = True
        self._extra_ids = np.union1d(self._extra_ids, new)
        self._extra = self._matrix(self._extra_ids)

    def matmul(self, h: np.ndarray, min_macs: int | None = None) -> np.ndarray:
        """h f32 [n, k] -> f32 [n, n_vocab]: the rows' products, -inf for the tokens without one."""
        h2 = h[None, :] if h.ndim == 1 else h
        out = np.full((h2.shape[0], self.m), -np.inf, np.float32)  # [n, n_vocab]
        out[:, : self.n_base] = self._base.matmul(h2, min_macs)
        if self._extra is not None:
            out[:, self._extra_ids] = self._extra.matmul(h2, min_macs)
        return out[0] if h.ndim == 1 else out


class FileRows:
    """rows(ids) of a GGUF tensor (mapped, not copied), with its ggml type."""

    def __init__(self, info):
        self._data, self.ggml_type = info.data, int(info.ggml_type)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self._data[ids])
