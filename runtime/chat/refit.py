"""Re-fitting a conversation that no longer fits: after /system, /undo or /regen past a context shift.

The conversation's rendering then shares no cached prefix beyond the kept start, and decoding it
whole would not fit in the context. `refit_plan` decides how it is fitted the way a context shift
would have left it — the first n_keep tokens, an older run dropped, the most recent tokens (the
whole last user message at least) — and `refit` rebuilds the cache and the token mirror so
(conv.tokens, n_keep_shift, n_dropped) describe it exactly as after a shift.
"""

from __future__ import annotations

import numpy as np

from kvchat.runtime.chat.events import ContextShifted


def common_prefix(a, b) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


def refit_plan(conv, desired: list[int]) -> tuple[int, int] | None:
    """(n_keep, n_drop) to fit a rendering the cache cannot serve incrementally, or None.

    After /system, /undo or /regen past a context shift, the conversation's rendering no
    longer shares a cached prefix beyond the kept start, and decoding it whole would not fit.
    It is fitted the way a context shift would have left it: the first n_keep tokens, then
    an older run dropped, then the most recent tokens — at least the whole last user message
    with what follows, at most half of what is left after n_keep. None when even the last
    message does not fit (the caller refuses with PromptTooLong)."""
    keep = min(conv.n_keep(), len(desired) - 1)
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
    start = (
        common_prefix(conv.render(conv.messages[: users[-1]], add_generation_prompt=False), desired)
        if users and users[-1] > 0
        else 0
    )
    must = len(desired) - max(start, keep)  # the last message and the generation prompt
    if keep + must > conv.n_ctx:
        return None
    tail = max(must, min(len(desired) - keep, (conv.n_ctx - keep) // 2))
    n_drop = len(desired) - keep - tail
    return (keep, n_drop) if n_drop > 0 else None


def refit(conv, desired: list[int], keep: int, n_drop: int) -> int:
    """Rebuild the cache as desired[:keep] + desired[keep + n_drop:]; returns tokens decoded."""
    cached = min(common_prefix(conv.tokens, desired), keep, conv.n_keep_shift if conv.n_dropped else len(conv.tokens))
    conv.tokens = conv.tokens[:cached]
    conv.n_dropped = conv.n_keep_shift = 0
    conv.logits = None
    conv._regen = None
    if not conv._remove_from(cached):
        conv._forget_all()
        cached = 0
    n = 0
    if cached < keep:
        conv._decode(desired[cached:keep])
        n += keep - cached
    conv.tokens = list(desired[: keep + n_drop])
    conv.n_keep_shift, conv.n_dropped = keep, n_drop
    if conv.on_prompt is not None:
        conv.on_prompt(desired[keep + n_drop :])
    conv._decode(desired[keep + n_drop :])
    conv.last_stats.n_shifted += n_drop
    conv.notify(ContextShifted(n_drop, keep))
    return n + len(desired) - keep - n_drop
