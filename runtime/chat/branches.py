"""Branches of one chat, each a sequence of the same cache, sharing the cells of their common
past; and alternatives of the last answer, decoded together.

- `fork(name)`: a new branch at the current point - `seq_cp` of every cell of the current
  sequence (unified cache: the new sequence id is added to the same cells, nothing is copied or
  recomputed; one stream per sequence: the stream is copied). The branch gets copies of the
  conversation's messages, token mirror and sampler state, so both continue as the original
  would have.
- `drop(name)`: `seq_rm` of the branch's sequence; only cells no other branch holds become free.
- `alternatives(n)`: the last answer is replaced by n answers sampled together from its prompt
  (one decode per step carrying a token of each), on the current sequence and n-1 free ones
  that share the prompt's cells; `pick(k)` keeps answer k in the current branch and removes the
  others' cells (`seq_keep` when no other branch lives in the stream, else `seq_rm` each).
- Context shift on a branch: a shift moves the positions of the cells after n_keep, and a cell
  shared with another branch holds one position for both - so `BranchConversation` refuses to
  shift when any of those cells is shared, and the answer stops with one line instead.
"""

from __future__ import annotations

import copy
import re

import numpy as np

from kvchat.runtime.chat.conversation import ContextFull, Conversation, FullCause, common_prefix
from kvchat.runtime.errors import KvchatError

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
INT_MAX = 2**31 - 1


def shared_cells_from(memory, seq_id: int, p0: int) -> int:
    """How many cells of seq_id at positions >= p0 also belong to another sequence."""
    n = 0
    for c in memory.kv_caches():
        cells = c.cells[c.seq_to_stream[seq_id]]
        idxs = cells.cells_of_seq(seq_id, p0, INT_MAX)
        n += int(np.count_nonzero(cells.nseq[idxs] > 1))
    return n


class BranchConversation(Conversation):
    """A Conversation that will not context-shift cells it shares with another branch."""

    def _shift_start(self) -> int:
        return self.n_keep_shift if self.n_dropped else min(self.n_keep(), self.n_cached)

    def shares_shift_range(self) -> bool:
        return shared_cells_from(self.ctx.memory, self.seq_id, self._shift_start()) > 0

    def _can_shift(self) -> bool:
        return super()._can_shift() and not self.shares_shift_range()

    def _free_cells(self) -> int:
        """Empty cells left in this sequence's stream of the (full-attention) cache."""
        caches = self.ctx.memory.kv_caches()
        if not caches:
            return 1 << 30
        c = caches[0]
        cells = c.cells[c.seq_to_stream[self.seq_id]]
        return int(cells.size - cells.get_used())

    def _make_room(self, pos: int, n: int):
        full = self.n_cached + n > self.n_ctx
        if (full and self.config.context_shift and self.shares_shift_range()) or (
            not full and self._free_cells() < n
        ):  # the other branches hold the rest
            self.notify(ContextFull(self.n_cached, self.n_ctx, FullCause.SHARED))
            return None
        return super()._make_room(pos, n)


def clone_conversation(conv: Conversation, seq_id: int) -> BranchConversation:
    """A conversation object on seq_id with conv's state (the cells are the caller's job)."""
    new = BranchConversation.__new__(BranchConversation)
    new.__dict__.update(conv.__dict__)
    for key in ("messages", "tokens", "config", "last_stats"):
        setattr(new, key, copy.deepcopy(getattr(conv, key)))
    new.sampler = copy.deepcopy(conv.sampler)
    new.logits = None if conv.logits is None else conv.logits.copy()
    new.seq_id = seq_id
    return new


class Branches:
    """Named conversations on sequences of one Context; one is current."""

    def __init__(self, conv: Conversation, name: str = "main"):
        self.ctx = conv.ctx
        self.items: dict[str, Conversation] = {name: conv}
        self.current = name
        self.pending = None  # (start token index, [Result]) after alternatives(), until pick()

    @property
    def conv(self) -> Conversation:
        return self.items[self.current]

    @property
    def n_seq_max(self) -> int:
        return int(self.ctx.cparams.n_seq_max)

    def seq_names(self) -> dict[int, str]:
        return {c.seq_id: name for name, c in self.items.items()}

    def free_seqs(self, n: int) -> list[int]:
        used = {c.seq_id for c in self.items.values()}
        free = [s for s in range(self.n_seq_max) if s not in used][:n]
        if len(free) < n:
            raise KvchatError(
                f"all {self.n_seq_max} sequences are in use (--parallel "
                f"{self.n_seq_max}): /drop a branch, or restart with a larger --parallel"
            )
        return free

    def _no_pending(self) -> None:
        if self.pending is not None:
            raise KvchatError("choose one of the alternatives first: /pick K")

    # ---- branches ------------------------------------------------------------------------------

    def fork(self, name: str) -> Conversation:
        self._no_pending()
        if not NAME_RE.match(name or ""):
            raise KvchatError("usage: /branch NAME (letters, digits, _ . -; at most 32)")
        if name in self.items:
            raise KvchatError(f"there is already a branch named {name} (/branches lists them)")
        (seq,) = self.free_seqs(1)
        cur = self.conv
        self.ctx.memory.seq_cp(cur.seq_id, seq, -1, -1)
        self.items[name] = clone_conversation(cur, seq)
        self.current = name
        return self.items[name]

    def switch(self, name: str) -> Conversation:
        self._no_pending()
        if name not in self.items:
            raise KvchatError(f"no branch named {name!r} (branches: {', '.join(self.items)})")
        self.current = name
        return self.conv

    def drop(self, name: str) -> int:
        """Remove a branch (not the current one); returns the number of cells freed."""
        self._no_pending()
        if name not in self.items:
            raise KvchatError(f"no branch named {name!r} (branches: {', '.join(self.items)})")
        if name == self.current:
            raise KvchatError(f"{name} is the current branch: /switch to another one first")
        conv = self.items.pop(name)
        before = self.used_cells()
        self.ctx.memory.seq_rm(conv.seq_id, -1, -1)
        return before - self.used_cells()

    def used_cells(self) -> int:
        return sum(cells.get_used() for c in self.ctx.memory.kv_caches() for cells in c.cells)

    def shared_with_current(self, conv) -> int:
        """Cells conv's sequence shares with the current branch's (0 across streams: copies)."""
        a, b = conv.seq_id, self.conv.seq_id
        n = 0
        for c in self.ctx.memory.kv_caches():
            if c.seq_to_stream[a] == c.seq_to_stream[b]:
                cells = c.cells[c.seq_to_stream[a]]
                n = max(n, int(np.count_nonzero(cells.seq[:, a] & cells.seq[:, b] & (cells.pos >= 0))))
        return n

    def tree(self) -> list[tuple[str, int, int, int, int, int, bool]]:
        """(name, seq, cached tokens, messages, cells shared with the current branch, common
        token prefix with it, is current) per branch."""
        cur = self.conv.cached_tokens()
        return [
            (
                name,
                c.seq_id,
                c.n_cached,
                len(c.messages),
                self.shared_with_current(c),
                common_prefix(c.cached_tokens(), cur),
                name == self.current,
            )
            for name, c in self.items.items()
        ]

    # ---- alternatives --------------------------------------------------------------------------

    def alternatives(self, n: int, seed: int) -> list:
        """Replace the last answer by n answers sampled together (seeds seed..seed+n-1)."""
        from kvchat.runtime.serving.parallel import ParallelRunner, continue_alternatives

        self._no_pending()
        conv = self.conv
        if n < 2:
            raise KvchatError("usage: /alts N with N >= 2")
        if not conv.messages or conv.messages[-1]["role"] != "assistant":
            raise KvchatError("nothing to show alternatives of: there is no answer yet")
        extra = self.free_seqs(n - 1)
        conv.messages.pop()
        conv.prefill(conv.render(conv.messages))  # rewinds to the prompt (decodes its last token)
        start, logits = len(conv.tokens), conv.logits.copy()
        mem = self.ctx.memory
        for s in extra:
            mem.seq_cp(conv.seq_id, s, -1, -1)
        runner = ParallelRunner(
            self.ctx,
            conv.vocab,
            conv.sampler.params,
            n,
            conv.config.n_predict,
            conv.config.ignore_eos,
            stop_event=conv.stop_event,
            constraint=getattr(conv, "constraint", None),
            reasoning=conv.reasoning_parser if conv.reasoning_parser([]) is not None else None,
        )
        results = continue_alternatives(
            runner, [conv.seq_id] + extra, conv.cached_tokens(), logits, [seed + i for i in range(n)], free=False
        )
        self.pending = (start, results)
        self._adopt(results[0])
        conv._regen = None
        return results

    def _adopt(self, res) -> None:
        """Make the current conversation's mirror follow alternative `res` (its seq's cells)."""
        conv = self.conv
        start, _ = self.pending
        decoded = res.ids[:-1] if res.stop == "limit" else res.ids
        conv.tokens = conv.tokens[:start] + [int(t) for t in decoded]
        conv.messages.append(
            {"role": "assistant", "content": res.text} | ({"reasoning_content": res.reasoning} if res.reasoning else {})
        )
        conv.logits = None if res.logits is None else np.array(res.logits, copy=True)

    def pick(self, k: int):
        """Keep alternative k (0-based) in the current branch; free the others' cells."""
        if self.pending is None:
            raise KvchatError("no alternatives to pick from: /alts N first")
        start, results = self.pending
        if not 0 <= k < len(results):
            raise KvchatError(f"/pick takes 1..{len(results)}")
        conv = self.conv
        mem = self.ctx.memory
        chosen = results[k]
        if chosen.seq_id != conv.seq_id:
            mem.seq_rm(conv.seq_id, -1, -1)
            mem.seq_cp(chosen.seq_id, conv.seq_id, -1, -1)
        others = [r.seq_id for r in results if r.seq_id != conv.seq_id]
        if len(self.items) == 1 and bool(getattr(self.ctx.cparams, "kv_unified", True)):
            mem.seq_keep(conv.seq_id)
        else:
            for s in others:
                mem.seq_rm(s, -1, -1)
        conv.messages.pop()
        self._adopt(chosen)
        conv._regen = None
        self.pending = None
        return chosen
