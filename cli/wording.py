"""What the engine reports, in words for people: events, stop reasons, and hints on errors.

runtime/ reports facts as data (kvchat.runtime.chat.conversation's ContextShifted / ContextFull events, a
StopReason in the turn's stats, PromptTooLong with its numbers); this module is the one place
that turns them into sentences, and the only one that knows which flags and slash commands a
user can reach for.
"""

from __future__ import annotations

from kvchat.runtime.chat.events import ContextFull, ContextShifted, FullCause, PromptTooLong, StopReason

_FULL_WHY = {
    FullCause.SHIFT_OFF: "context shift is off",
    FullCause.CANNOT_SHIFT: (
        "this model's cache cannot shift (sliding-window layers: restart with --swa-full to allow it)"
    ),
    FullCause.RECURRENT: "this model's recurrent state cannot drop old tokens",
    FullCause.KEEP_ALL: (
        "--keep covers all of it, so nothing can be dropped (/set keep N with "
        "a smaller N, or restart with a smaller --keep)"
    ),
    FullCause.SHARED: (
        "the other branches share or hold the cells (a shift would move shared "
        "cells for every branch; /drop a branch to make room)"
    ),
}


def event_text(event) -> str:
    """One line for a conversation event."""
    if isinstance(event, ContextShifted):
        return f"context full: dropped {event.n_dropped} tokens after the first {event.n_keep} to make room"
    if isinstance(event, ContextFull):
        return (
            f"context full ({event.n_cached}/{event.n_ctx} tokens) and {_FULL_WHY[event.cause]}: "
            "answer stopped (/clear, /undo, or restart with a larger -c)"
        )
    return str(event)


def stop_text(stats, n_predict: int) -> str | None:
    """The chat's line after an answer that did not end on its own (None: nothing to say)."""
    if stats.stop == StopReason.INTERRUPTED:
        return "stopped (the partial answer is kept)"
    if stats.stop == StopReason.LIMIT:
        return f"answer cut at -n {n_predict} tokens"
    return None  # EOG: finished; CTX_FULL: its event said why


def error_text(error: Exception, in_chat: bool = False) -> str:
    """An error's one line, with what the user can do about it where we know."""
    text = str(error)
    if isinstance(error, PromptTooLong):
        text += "; shorten it, /clear, or raise -c" if in_chat else "; shorten it or raise -c"
    return text
