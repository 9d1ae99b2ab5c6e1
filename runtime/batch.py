"""Batches: what a caller hands to decode(), and how it is checked, completed and split.

`Batch` is the public input (llama_batch): tokens, optional positions, optional sequence ids
(several per token allowed: one cell shared by all of them), optional output flags.
`BatchAllocator` (llama_batch_allocr) validates a batch against the vocabulary and the memory
(positions must continue each sequence's last position in memory), fills what is missing
(positions from memory, sequence 0, an output for the last token), then cuts it into `UBatch`es:

- split_simple: consecutive tokens, n_ubatch at a time (one stream);
- split_equal: every sequence set gets the same number of tokens (needed when each sequence
  lives in its own stream: one slot search per stream, same length each);
- split_seq: one sequence set per ubatch.

If a split leaves tokens unused (n_used < n_tokens) the batch cannot be processed.
"""

from __future__ import annotations

import numpy as np

_NO_I32 = np.zeros(0, np.int32)  # the empty fields of a cleared allocator (length 0: never written)
_NO_BOOL = np.zeros(0, bool)
_POS_MAX = np.iinfo(np.int32).max - 1  # the last position a batch may use


def _position_gap(seq: int, p_mem: int, p_batch: int) -> str:
    """init()'s refusal of a batch whose sequence does not continue at memory's last position + 1
    (BatchAllocator and OneToken word it alike)."""
    return (
        f"the tokens of sequence {seq} in the input batch have inconsistent sequence "
        f"positions: the last position stored in memory for sequence {seq} is X = {p_mem}, "
        f"the batch starts at Y = {p_batch}; it is required that Y = X + 1"
    )


class Batch:
    """A decode() input. tokens i32 [n]; pos i32 [n] or None (continue from memory);
    seq_ids: None (all seq 0), one int per token, or one list of ints per token;
    logits: bool [n] or None (only the last token is an output)."""

    __slots__ = ("tokens", "pos", "seq_ids", "logits")

    def __init__(self, tokens, pos=None, seq_ids=None, logits=None):
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [n] (i64: range check first)
        n = self.tokens.shape[0]
        self.pos = None if pos is None else np.asarray(pos, dtype=np.int64).reshape(-1)
        if seq_ids is None:
            self.seq_ids = None
        else:
            self.seq_ids = [[int(s)] if np.isscalar(s) else [int(x) for x in s] for s in seq_ids]
        self.logits = None if logits is None else np.asarray(logits, dtype=bool).reshape(-1)
        for name, arr in (("pos", self.pos), ("seq_ids", self.seq_ids), ("logits", self.logits)):
            if arr is not None and len(arr) != n:
                raise ValueError(f"batch {name} has {len(arr)} entries for {n} tokens")

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.n_tokens

    @classmethod
    def one_seq(cls, tokens, pos0: int, seq_id: int = 0, all_logits: bool = False) -> "Batch":
        """Tokens of one sequence at positions pos0, pos0+1, ...; output for the last or all.
        Built directly (every field already has its type and length): a generated token comes
        through here once per step."""
        b = cls.__new__(cls)
        b.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [n]
        n = b.tokens.shape[0]
        b.pos = np.arange(pos0, pos0 + n, dtype=np.int64)  # [n]
        s = int(seq_id)
        b.seq_ids = [[s] for _ in range(n)]
        b.logits = np.ones(n, dtype=bool) if all_logits else None
        return b


class UBatch:
    """One forward pass worth of tokens (llama_ubatch), in numpy arrays.

    token i32 [n]; pos i32 [n]; seq_id: list of lists (the first entry of each is the token's
    "own" sequence, used for masking); seq0 i32 [n] = first seq of each token; output bool [n];
    batch_idx i32 [n] = index of each token in the Batch (to place output rows)."""

    __slots__ = (
        "token",
        "pos",
        "seq_id",
        "seq0",
        "output",
        "batch_idx",
        "n_tokens",
        "n_seq_tokens",
        "n_seqs",
        "n_seqs_unq",
        "seq_id_unq",
        "equal_seqs",
        "multi_seq",
        "n_outputs",
    )

    def __init__(self, token, pos, seq_id, output, batch_idx, n_seqs, equal_seqs):
        self.token = token
        self.pos = pos
        self.seq_id = seq_id
        self.output = output
        self.batch_idx = batch_idx
        n = int(pos.shape[0])
        self.n_tokens = n
        self.n_seqs = n_seqs
        self.n_seq_tokens = n // n_seqs if n_seqs else 0
        self.equal_seqs = equal_seqs
        self.seq0 = np.fromiter((s[0] for s in seq_id), dtype=np.int32, count=n)
        self.multi_seq = any(len(s) > 1 for s in seq_id)
        if self.multi_seq:
            unq = sorted({x for s in seq_id for x in s})
        else:
            unq = sorted(set(self.seq0.tolist()))  # as np.unique, which imports numpy.ma
        self.seq_id_unq = unq
        self.n_seqs_unq = len(unq)
        self.n_outputs = int(np.count_nonzero(output))

    def __repr__(self) -> str:
        return (
            f"UBatch(n_tokens={self.n_tokens}, n_seqs={self.n_seqs}, "
            f"seqs={self.seq_id_unq}, pos={self.pos.tolist()[:8]}...)"
        )


class BatchAllocator:
    """Validates and completes a Batch, then splits it into ubatches (llama_batch_allocr)."""

    def __init__(self):
        self.error = ""
        self._clear()

    def _clear(self):
        self.n_tokens = 0
        self.n_outputs = 0
        self.token = _NO_I32
        self.pos = _NO_I32
        self.seq_id: list[list[int]] = []
        self.seq_set: list[frozenset] = []
        self.seq_set_map: dict[frozenset, list[int]] = {}
        self.output = _NO_BOOL
        self.has_cpl = False
        self._seq_pos: dict[int, tuple[int, int, int]] = {}  # seq -> (min, max, n distinct)
        self.out_ids: list[int] = []
        self.used = _NO_BOOL
        self.n_used = 0
        self.seq_id_unq: list[int] = []

    # ---- init ------------------------------------------------------------------------------

    def _fail(self, msg: str) -> bool:
        self.error = msg
        return False

    def init(self, batch: Batch, n_vocab: int, n_seq_max: int, memory=None, output_all: bool = False) -> bool:
        """Validate and complete `batch`; False (with .error set) if it is invalid."""
        self._clear()
        self.error = ""
        n = batch.n_tokens
        if n == 0:
            return self._fail("n_tokens == 0")
        toks = batch.tokens
        bad = np.flatnonzero((toks < 0) | (toks >= n_vocab))
        if bad.size:
            i = int(bad[0])
            return self._fail(f"invalid token[{i}] = {int(toks[i])} (n_vocab = {n_vocab})")

        if batch.seq_ids is None:
            seq_id = [[0] for _ in range(n)]
        else:
            seq_id = batch.seq_ids
            for i, ss in enumerate(seq_id):
                if not ss:
                    return self._fail(f"token {i} has no sequence id")
                for s in ss:
                    if s < 0 or s >= n_seq_max:
                        return self._fail(f"invalid seq_id[{i}] = {s} >= n_seq_max {n_seq_max}")
                if len(set(ss)) != len(ss):
                    return self._fail(f"token {i} lists a sequence id twice: {ss}")

        if batch.pos is None:
            # continue each sequence from its last position in memory
            pos = np.empty(n, dtype=np.int64)
            nxt: dict[int, int] = {}
            for i, ss in enumerate(seq_id):
                s0 = ss[0]
                if s0 not in nxt:
                    nxt[s0] = (memory.seq_pos_max(s0) + 1) if memory is not None else 0
                p = nxt[s0]
                pos[i] = p
                for s in ss:
                    nxt[s] = p + 1
        else:
            pos = batch.pos
            if np.any(pos < 0) or np.any(pos > _POS_MAX):
                return self._fail("batch positions must be in [0, 2^31-1)")

        if batch.logits is None:
            output = np.zeros(n, dtype=bool)
            output[-1] = True
        else:
            output = batch.logits.copy()
        if output_all:
            output[:] = True

        self.n_tokens = n
        self.token = toks.astype(np.int32)
        self.pos = pos.astype(np.int32)
        self.seq_id = seq_id
        self.output = output
        self.n_outputs = int(np.count_nonzero(output))

        # per-sequence position sets and coupling (a token in several sequences couples them)
        seq_positions: dict[int, set] = {}
        cpl: set[tuple[int, int]] = set()
        single = all(len(ss) == 1 for ss in seq_id)
        if single:
            seq0 = np.fromiter((ss[0] for ss in seq_id), dtype=np.int32, count=n)
            for s in sorted(set(seq0.tolist())):  # np.unique's order (np.unique imports numpy.ma)
                p = self.pos[seq0 == s]
                seq_positions[s] = p
        else:
            for i, ss in enumerate(seq_id):
                p = int(self.pos[i])
                for k, s in enumerate(ss):
                    seq_positions.setdefault(s, []).append(p)
                    if k > 0:
                        cpl.add((s, ss[0]))
            seq_positions = {s: np.asarray(v, dtype=np.int32) for s, v in seq_positions.items()}
        self.has_cpl = bool(cpl)
        for s, p in seq_positions.items():
            self._seq_pos[s] = (int(p.min()), int(p.max()), len(set(p.tolist())))  # distinct positions

        self.seq_set = [frozenset(ss) for ss in seq_id]
        for i, st in enumerate(self.seq_set):
            self.seq_set_map.setdefault(st, []).append(i)
        self.seq_id_unq = sorted(self._seq_pos)

        # positions must continue what memory holds, without gaps
        for s, (pmin, pmax, ndist) in self._seq_pos.items():
            if memory is not None:
                p0 = memory.seq_pos_max(s)
                if p0 >= 0 and pmin != p0 + 1:
                    return self._fail(_position_gap(s, p0, pmin))
            if pmax - pmin + 1 > ndist:
                return self._fail(f"sequence {s} positions are not continuous")

        if memory is not None:
            for s0, s1 in cpl:
                if memory.seq_pos_min(s0) != memory.seq_pos_min(s1) or memory.seq_pos_max(s0) != memory.seq_pos_max(s1):
                    return self._fail(
                        f"sequence {s0} is coupled to {s1} in the input batch, but they have diverged in memory"
                    )

        # no partial sequence sub-sets, no decreasing positions within a sequence
        if single:
            for s in self._seq_pos:
                if np.any(np.diff(seq_positions[s]) < 0):
                    return self._fail(f"sequence {s} positions are decreasing (not allowed)")
        else:
            cur_set: dict[int, frozenset] = {}
            cur_pos: dict[int, int] = {}
            for i, ss in enumerate(seq_id):
                p = int(self.pos[i])
                st = self.seq_set[i]
                for s in ss:
                    cs = cur_set.get(s)
                    cs = st if cs is None else (cs & st)
                    if not cs:
                        return self._fail(f"sequence {s} belongs to incompatible sequence sets (not allowed)")
                    cur_set[s] = cs
                    if p < cur_pos.get(s, -1):
                        return self._fail(f"sequence {s} positions are decreasing (not allowed)")
                    cur_pos[s] = p

        self.split_reset()
        return True

    # ---- queries ---------------------------------------------------------------------------

    def get_n_tokens(self) -> int:
        return self.n_tokens

    def get_n_outputs(self) -> int:
        return self.n_outputs

    def get_n_used(self) -> int:
        return self.n_used

    def seq_pos_min(self, s: int) -> int:
        v = self._seq_pos.get(s)
        return -1 if v is None else v[0]

    def seq_pos_max(self, s: int) -> int:
        v = self._seq_pos.get(s)
        return -1 if v is None else v[1]

    # ---- splitting -------------------------------------------------------------------------

    def split_reset(self) -> None:
        self.out_ids = []
        self.n_used = 0
        self.used = np.zeros(self.n_tokens, dtype=bool)

    def _first_unused(self) -> int:
        free = np.flatnonzero(~self.used)
        return int(free[0]) if free.size else self.n_tokens

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """The next run of up to n_ubatch consecutive unused tokens; None when done."""
        i0 = self._first_unused()
        if i0 >= self.n_tokens:
            return None
        i1 = min(self.n_tokens, i0 + n_ubatch)
        idxs = np.arange(i0, i1, dtype=np.int32)
        return self._ubatch_add(idxs, len(idxs), equal_seqs=False)

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch | None:
        """Non-overlapping sequence sets, each with the same number of tokens; None when done
        (or when a sequential split is impossible because sequences are coupled)."""
        if sequential and self.has_cpl:
            self.error = "sequential split is not supported when there are coupled sequences in the input batch"
            return None
        cur: list[frozenset] = []
        last = -1
        for i in np.flatnonzero(~self.used).tolist():
            st = self.seq_set[i]
            if any(cs & st for cs in cur):
                continue
            if sequential and cur and self.seq_id[i][0] != last + 1:
                continue
            cur.append(st)
            last = self.seq_id[i][0]
            if len(cur) >= n_ubatch:
                break
        n_seqs = len(cur)
        if n_seqs == 0:
            return None
        lists = [self.seq_set_map[st] for st in cur]
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while self.used[lists[s][cur_idx[s]]]:
                cur_idx[s] += 1
        per_seq: list[list[int]] = [[] for _ in range(n_seqs)]
        while all(cur_idx[s] < len(lists[s]) for s in range(n_seqs)):
            for s in range(n_seqs):
                idx = lists[s][cur_idx[s]]
                per_seq[s].append(idx)
                self.used[idx] = True
                self.n_used += 1
                cur_idx[s] += 1
            if (len(per_seq[0]) + 1) * n_seqs > n_ubatch:
                break
        idxs = np.asarray([i for lst in per_seq for i in lst], dtype=np.int32)
        return self._ubatch_add(idxs, n_seqs, equal_seqs=True, mark=False)

    def split_seq(self, n_ubatch: int) -> UBatch | None:
        """Tokens whose sequence set is a subset of the current one, one set per ubatch."""
        i = self._first_unused()
        if i >= self.n_tokens:
            return None
        cur_set = self.seq_set[i]
        idxs = []
        while True:
            idxs.append(i)
            self.used[i] = True
            self.n_used += 1
            if len(idxs) >= n_ubatch:
                break
            i += 1
            while i < self.n_tokens and (self.used[i] or not (self.seq_set[i] <= cur_set)):
                i += 1
            if i >= self.n_tokens:
                break
            cur_set = self.seq_set[i]
        return self._ubatch_add(np.asarray(idxs, dtype=np.int32), 1, equal_seqs=True, mark=False)

    def _ubatch_add(self, idxs: np.ndarray, n_seqs: int, equal_seqs: bool, mark: bool = True) -> UBatch:
        if mark:
            self.used[idxs] = True
            self.n_used += int(idxs.size)
        out = self.output[idxs]
        self.out_ids.extend(idxs[out].tolist())
        seq_id = [self.seq_id[i] for i in idxs.tolist()]
        return UBatch(self.token[idxs], self.pos[idxs], seq_id, out, idxs, n_seqs, equal_seqs)


_OUT1 = np.ones(1, dtype=bool)  # a generated token's output flag (read only)
_IDX0 = np.zeros(1, dtype=np.int32)  # its batch index
_OUT1.flags.writeable = False
_IDX0.flags.writeable = False


class OneToken:
    """The allocator of one generated token in one sequence (Context.decode_one): what
    BatchAllocator.init checks and leaves for Batch.one_seq([token], pos, seq), checked in the same
    order with the same messages on Python scalars, and the one ubatch every split hands out once.
    It answers what a memory asks of an allocator (init_batch: the splits, get_n_tokens,
    get_n_used, has_cpl); tests/test_batch_one_token.py holds decode_one to decode."""

    n_tokens = n_outputs = 1
    has_cpl = False

    def __init__(self):
        self.error = ""
        self.used = False

    def init(self, token: int, pos: int, seq: int, n_vocab: int, n_seq_max: int, memory) -> bool:
        """Validate the token at `pos` of sequence `seq`; False (with .error set) if invalid."""
        if token < 0 or token >= n_vocab:
            self.error = f"invalid token[0] = {token} (n_vocab = {n_vocab})"
        elif seq < 0 or seq >= n_seq_max:
            self.error = f"invalid seq_id[0] = {seq} >= n_seq_max {n_seq_max}"
        elif pos < 0 or pos > _POS_MAX:
            self.error = "batch positions must be in [0, 2^31-1)"
        elif 0 <= memory.seq_pos_max(seq) != pos - 1:
            self.error = _position_gap(seq, memory.seq_pos_max(seq), pos)
        else:
            self.error = ""
            self.token = np.array([token], dtype=np.int32)
            self.pos = np.array([pos], dtype=np.int32)
            self.seq_id = [[seq]]
            self.used = False
        return not self.error

    def split_reset(self) -> None:
        self.used = False

    def get_n_tokens(self) -> int:
        return 1

    def get_n_outputs(self) -> int:
        return 1

    def get_n_used(self) -> int:
        return int(self.used)

    def _take(self, equal_seqs: bool) -> UBatch | None:
        if self.used:
            return None
        self.used = True
        return UBatch(self.token, self.pos, self.seq_id, _OUT1, _IDX0, 1, equal_seqs)

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        return self._take(False)

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch | None:
        return self._take(True)

    def split_seq(self, n_ubatch: int) -> UBatch | None:
        return self._take(True)
