"""SentencePiece-style (SPM) tokenization of one text fragment, as llama.cpp's llm_tokenizer_spm does it.

The text (spaces already escaped to U+2581 by the caller) starts as one symbol per Unicode
character. Every adjacent pair whose concatenation is a vocabulary entry is a candidate merge;
the candidate with the highest score wins (ties: the leftmost), the pair becomes one symbol, and
its new neighbours become candidates. Symbols left that are not in the vocabulary (only single
characters can be, since merges only ever produce vocabulary entries) fall back to one byte token
per UTF-8 byte.

Symbols live in flat lists (start, length, prev, next) instead of objects so the loop stays cheap:
the 35 KB GPL text is one fragment of ~35k symbols for Gemma.
"""

from __future__ import annotations

import heapq
from typing import Callable


def spm_tokenize(text: str, token_to_id: dict, scores: list, byte_token: Callable[[int], int]) -> list[int]:
    """Token ids for `text` (already whitespace-escaped); `scores[id]` ranks merges, higher first."""
    n = len(text)
    if n == 0:
        return []
    start = list(range(n))
    length = [1] * n
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prev = list(range(-1, n - 1))
    lookup = token_to_id.get
    heap: list = []
    push = heapq.heappush

    def add_candidate(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        size = length[left] + length[right]
        s = start[left]
        tid = lookup(text[s : s + size])
        if tid is not None:
            # heapq pops the smallest: negate the score so the highest score comes first,
            # then the leftmost symbol; `size` lets us recognise candidates made stale by a merge.
            push(heap, (-scores[tid], left, right, size))

    for i in range(1, n):
        add_candidate(i - 1, i)

    pop = heapq.heappop
    while heap:
        _, left, right, size = pop(heap)
        len_l = length[left]
        len_r = length[right]
        if len_l == 0 or len_r == 0 or len_l + len_r != size:
            continue
        length[left] = size
        length[right] = 0
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prev[after] = left
        add_candidate(prev[left], left)
        add_candidate(left, after)

    out: list[int] = []
    i = 0
    while i != -1:
        s = start[i]
        piece = text[s : s + length[i]]
        tid = lookup(piece)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(byte_token(b) for b in piece.encode("utf-8"))
        i = nxt[i]
    return out
