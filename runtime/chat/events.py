"""What a conversation turn reports, as data: its stats and stop reason, the events that happen
during it (a context shift, a full context that stops the answer), and the prompt that cannot
fit. runtime/chat/conversation.py produces them; cli/wording.py words them for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvchat.runtime.errors import KvchatError
from kvchat.runtime.generate import StopReason


class PromptTooLong(KvchatError):
    """The new tokens of a turn cannot fit in the context, even after dropping old ones."""

    def __init__(self, n_new: int, room: int, n_ctx: int):
        super().__init__(f"the prompt needs {n_new} new tokens but only {room} fit in the context of {n_ctx} tokens")
        self.n_new, self.room, self.n_ctx = n_new, room, n_ctx


class FullCause(str, Enum):
    """Why a full context stopped the answer instead of shifting."""

    SHIFT_OFF = "shift_off"  # --no-context-shift
    CANNOT_SHIFT = "cannot_shift"  # the memory cannot move positions (iSWA without swa_full)
    RECURRENT = "recurrent"  # a recurrent state cannot drop old tokens (recurrent, hybrid)
    KEEP_ALL = "keep_all"  # --keep covers everything cached: nothing may be dropped
    SHARED = "shared"  # other branches share or hold the cells (runtime/chat/branches.py)


@dataclass(frozen=True)
class ContextShifted:
    """A context shift dropped `n_dropped` tokens after the first `n_keep`."""

    n_dropped: int
    n_keep: int


@dataclass(frozen=True)
class ContextFull:
    """The answer stopped at a full context (`n_cached` of `n_ctx`) for `cause`."""

    n_cached: int
    n_ctx: int
    cause: FullCause


@dataclass
class TurnStats:
    n_prompt: int = 0  # tokens decoded before the answer (new ones only)
    t_prompt: float = 0.0  # seconds
    n_gen: int = 0  # answer tokens sampled
    n_gen_decoded: int = 0  # answer tokens decoded (the last one usually is not)
    n_thinking: int = 0  # of n_gen, tokens inside thinking spans
    t_gen: float = 0.0
    n_shifted: int = 0  # tokens dropped by context shifts during this turn
    stop: StopReason | str = ""  # why the answer ended ("" while running or after an exception)
    n_drafted: int = 0  # speculative decoding: draft tokens verified
    n_accepted: int = 0  # ... and accepted
    n_verify: int = 0  # ... verify batches

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.t_prompt if self.t_prompt > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_gen_decoded / self.t_gen if self.t_gen > 0 else 0.0
