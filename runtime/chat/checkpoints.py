"""Sequence checkpoints for memories that cannot cut a sequence (recurrent and hybrid).

A KV cache holds every position, so rewinding a conversation (/regen, /undo, an edited
prompt) is `seq_rm` of the tail. A recurrent state holds no positions: its `seq_rm` of a tail
returns False. So the conversation takes checkpoints (Memory.seq_checkpoint: the sequence's
state blob) at the points it may come back to - before a prompt is decoded and before the
answer starts - and rewinds by restoring the latest one at or before the target
(Memory.seq_restore: the state, and the KV tail of a hybrid trimmed), then re-decoding only
the tokens from there. Keyed by the number of cached tokens at the time; the oldest go first.
"""

from __future__ import annotations


class SeqCheckpoints:
    def __init__(self, ctx, seq_id: int, keep: int = 4):
        self.ctx = ctx  # the Context (its memory is read at each use)
        self.seq_id = seq_id
        self.keep = keep
        self.points: dict[int, object] = {}  # n_cached -> SeqCheckpoint

    @property
    def memory(self):
        return self.ctx.memory

    @property
    def needed(self) -> bool:
        """Whether the memory needs them (it refuses to remove a sequence's tail)."""
        can = getattr(self.memory, "get_can_trim", None)
        return callable(can) and not can()

    def take(self, n_cached: int) -> None:
        """Checkpoint the sequence as it is now, holding n_cached tokens (no-op if not needed)."""
        if not self.needed or n_cached <= 0 or n_cached in self.points:
            return
        self.points[n_cached] = self.memory.seq_checkpoint(self.seq_id)
        while len(self.points) > self.keep:
            del self.points[min(self.points)]

    def restore(self, n_cached: int) -> int:
        """Bring the sequence back to the latest checkpoint holding at most n_cached tokens;
        returns how many tokens it holds then, or -1 (nothing changed) when there is none."""
        for n in sorted((n for n in self.points if n <= n_cached), reverse=True):
            if self.memory.seq_restore(self.seq_id, self.points[n]):
                self.drop_after(n)
                return n
        return -1

    def drop_after(self, n_cached: int) -> None:
        """Forget checkpoints of states past n_cached tokens (their tokens are gone)."""
        for n in [n for n in self.points if n > n_cached]:
            del self.points[n]

    def clear(self) -> None:
        self.points.clear()

    @property
    def n_bytes(self) -> int:
        return sum(c.n_bytes for c in self.points.values())
