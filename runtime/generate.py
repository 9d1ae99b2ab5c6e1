"""The two loops every command runs on a Context: decode a run of tokens, and generate.

`decode_tokens(ctx, ids, pos0, seq)` decodes a run of one sequence's tokens in pieces of n_batch,
as llama.cpp's tools do (one `llama_decode` per n_batch slice of the prompt). Chat prefill,
`bench`, `perplexity`, the kernel warm-up and `logprobs` all go through it, so a decode failure
means the same thing everywhere: `Interrupted` (the abort callback fired) or `DecodeError`, each
saying how many tokens of the run made it into memory.

`generate(ctx, sample, ...)` is the sample → decode loop (each generated token through
`Context.decode_one`), modelled on mlx-lm's `generate_step`:
an iterator of `Step`s (the token and, on demand, its log-probability under the model), which
ends for a reason that is data — `StopReason` — so each caller words it for its own users. What
to do when the sequence is full is the caller's policy (`make_room`): the chat's context shift,
or stopping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from kvchat.runtime.errors import KvchatError, ModelOutputError


class StopReason(str, Enum):
    """Why a generation ended. A str, so `stats.stop == "eog"` reads naturally."""

    EOG = "eog"  # the model ended its turn (an end-of-generation token)
    LIMIT = "limit"  # max_tokens reached
    INTERRUPTED = "interrupted"  # the stop event was set, or the abort callback stopped a decode
    CTX_FULL = "ctx_full"  # no room for the next token and make_room could not make any

    def __str__(self) -> str:
        return self.value


class Interrupted(Exception):
    """The abort callback stopped a decode (Ctrl-C). `n_done` tokens of the run are in memory
    (the pieces before the stopped one); the stopped piece was rolled back by the Context."""

    def __init__(self, n_done: int = 0):
        super().__init__(f"interrupted after {n_done} tokens")
        self.n_done = n_done


class DecodeError(KvchatError):
    """Context.decode refused or failed a piece (`code` as llama_decode returns it: 1 = no room
    in the memory, -1 invalid batch, -2/-3 failures); `n_done` tokens of the run are in memory."""

    def __init__(self, message: str, code: int = 0, n_done: int = 0):
        super().__init__(message)
        self.code = code
        self.n_done = n_done


def _one_seq_batch(tokens, pos0, seq_id, all_logits=False):
    from kvchat.runtime.batch import Batch

    return Batch.one_seq(tokens, pos0, seq_id, all_logits=all_logits)


def n_batch_of(ctx) -> int:
    """The most tokens one decode() call takes (cparams.n_batch)."""
    return int(getattr(getattr(ctx, "cparams", None), "n_batch", 0) or 0)


def decode_pieces(
    ctx,
    ids: Sequence[int],
    pos0: int,
    seq: int = 0,
    *,
    outputs="last",
    batch_factory: Optional[Callable] = None,
    tuned: bool = False,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Decode `ids` at positions pos0, pos0+1, ... of sequence `seq`, n_batch tokens per call;
    after each call yield (idx i64 [m], rows f32 [m, n_vocab]): the indices into `ids` of that
    piece's output tokens and their logits (the context's buffer: use them before advancing).

    outputs: "last" (the last token of each piece), "all", or a bool mask [len(ids)] of the tokens
    whose logits are wanted (perplexity scores only the second half of a chunk; a piece without
    any still computes its last token, and yields nothing). batch_factory(tokens i32[n], pos0,
    seq, all_logits=False) builds "last"/"all" batches (tests plug in their own).
    Raises Interrupted or DecodeError; the pieces before a failed one stay decoded."""
    ids = np.asarray(ids, dtype=np.int32)  # [n]
    n = int(ids.size)
    if n == 0:
        raise ValueError("decode_tokens: no tokens to decode")
    mask = None
    if not isinstance(outputs, str):
        mask = np.asarray(outputs, dtype=bool)  # [n]
        if mask.shape != (n,):
            raise ValueError(f"decode_tokens: outputs mask has shape {mask.shape}, not ({n},)")
    elif outputs not in ("last", "all"):
        raise ValueError(f"decode_tokens: outputs must be 'last', 'all' or a mask, not {outputs!r}")
    make = batch_factory or _one_seq_batch
    step = n_batch_of(ctx) or n
    for i in range(0, n, step):
        piece = ids[i : i + step]
        if mask is not None:
            want = mask[i : i + step].copy()
            idx = np.nonzero(want)[0].astype(np.int64) + i
            if not want.any():
                want[-1] = True  # a decode computes at least one output; not yielded
            from kvchat.runtime.batch import Batch

            batch = Batch(
                piece,
                pos=np.arange(pos0 + i, pos0 + i + piece.size, dtype=np.int64),
                seq_ids=[seq] * int(piece.size),
                logits=want,
            )
        elif outputs == "all":
            idx = np.arange(i, i + piece.size, dtype=np.int64)
            batch = make(piece, pos0 + i, seq, all_logits=True)
        else:
            idx = np.array([i + piece.size - 1], dtype=np.int64)
            batch = make(piece, pos0 + i, seq)
        rc = ctx.decode_tuned(batch) if tuned else ctx.decode(batch)
        if rc == 2:
            raise Interrupted(i)
        if rc != 0:
            raise DecodeError(_decode_failure(ctx, rc, len(piece), pos0 + i), rc, i)
        if idx.size:
            yield idx, (ctx.get_logits() if mask is not None or outputs == "all" else ctx.get_logits_ith(-1)[None, :])


def decode_tokens(
    ctx,
    ids: Sequence[int],
    pos0: int,
    seq: int = 0,
    *,
    logits: str = "last",
    on_logits: Optional[Callable[[int, np.ndarray], None]] = None,
    batch_factory: Optional[Callable] = None,
    tuned: bool = False,
) -> Optional[np.ndarray]:
    """Decode `ids` at positions pos0, pos0+1, ... of sequence `seq`, n_batch tokens per call
    (decode_pieces, consumed).

    logits: "last" → a copy of the last token's logits, f32 [n_vocab]; "all" → every token's,
    f32 [len(ids), n_vocab] (logprobs); "none" → None (bench, cache fills), only the last token
    of each piece is computed as an output. on_logits(i, rows) with "all": called after each
    piece with its first index in ids and its rows f32 [n_piece, n_vocab] (valid until the next
    decode) instead of keeping them — a long text never holds all its logits.
    tuned: a few tokens generated for one sequence (a speculative verify), decoded on the launch
    tuner's arm (Context.decode_tuned).
    Raises Interrupted or DecodeError; the pieces before a failed one stay decoded.
    """
    if logits not in ("last", "all", "none"):
        raise ValueError(f"decode_tokens: logits must be 'last', 'all' or 'none', not {logits!r}")
    rows = []
    for idx, r in decode_pieces(
        ctx, ids, pos0, seq, outputs="all" if logits == "all" else "last", batch_factory=batch_factory, tuned=tuned
    ):
        if logits == "all" and on_logits is not None:
            on_logits(int(idx[0]), r)
        elif logits == "all":
            rows.append(np.array(r, dtype=np.float32, copy=True))
    if logits == "last":
        return np.array(ctx.get_logits_ith(-1), dtype=np.float32, copy=True)
    if logits == "all" and rows:
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)
    return None


def decode_one(ctx, token: int, pos: int, seq: int = 0) -> np.ndarray:
    """ctx.decode_one (a generated token's step) -> a copy of the token's logits f32 [n_vocab];
    Interrupted or DecodeError as decode_tokens raises them."""
    rc = ctx.decode_one(token, pos, seq)
    if rc == 2:
        raise Interrupted(0)
    if rc != 0:
        raise DecodeError(_decode_failure(ctx, rc, 1, pos), rc, 0)
    return np.array(ctx.get_logits_ith(-1), dtype=np.float32, copy=True)


def _decode_failure(ctx, rc: int, n: int, pos: int) -> str:
    if rc == 1:
        return f"no room in the KV cache for {n} tokens ({pos}/{ctx.n_ctx} used)"
    why = getattr(ctx, "last_error", "")
    return f"decode failed with code {rc}" + (f": {why}" if why else "")


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """Natural-log probability of `token` under softmax(logits), in float64. logits f32 [n_vocab]."""
    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


@dataclass
class Step:
    """One generated token. `logits` f32 [n_vocab] are the model's raw scores it was drawn from."""

    token: int
    logits: np.ndarray
    index: int  # 0 for the first generated token

    @property
    def logprob(self) -> float:
        """log p(token) under the model (before sampling's penalties and temperature)."""
        return log_softmax_at(self.logits, self.token)


class Generation:
    """The iterator `generate()` returns. Iterate it for Steps; afterwards `.stop` says why it
    ended (None if the consumer stopped early), `.n_decoded` how many generated tokens were
    decoded (the last one usually is not: it is sampled, yielded, and the limit stops), `.seconds`
    the wall time spent inside the loop, `.pos` the position the next token would take."""

    def __init__(
        self,
        ctx,
        sample,
        logits,
        pos,
        seq,
        max_tokens,
        is_eog,
        stop_event,
        make_room,
        on_decoded,
        batch_factory,
        is_last=None,
    ):
        self.ctx = ctx
        self.sample = sample
        self.logits = logits
        self.pos = pos
        self.seq = seq
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.stop_event = stop_event
        self.make_room = make_room or self._fits
        self.on_decoded = on_decoded
        self.batch_factory = batch_factory
        self.is_last = is_last
        self.stop: Optional[StopReason] = None
        self.n_sampled = 0
        self.n_decoded = 0
        self.seconds = 0.0

    def _fits(self, pos: int, n: int) -> Optional[int]:
        """Default room policy: no shifting; stop when the sequence's context is full."""
        n_ctx = int(getattr(self.ctx, "n_ctx_seq", 0) or self.ctx.n_ctx)
        return pos if pos + n <= n_ctx else None

    def _decode(self, token: int) -> np.ndarray:
        """Decode a generated token (Context.decode_one; a test's batch_factory goes through
        decode_tokens) -> a copy of its logits f32 [n_vocab]. Raises Interrupted or DecodeError."""
        if self.batch_factory is not None:
            return decode_tokens(self.ctx, [token], self.pos, self.seq, batch_factory=self.batch_factory)
        return decode_one(self.ctx, token, self.pos, self.seq)

    def __iter__(self) -> Iterator[Step]:
        t0 = time.perf_counter()
        try:
            self.stop = yield from self._steps()
        finally:
            self.seconds += time.perf_counter() - t0

    def _steps(self):
        while True:
            if 0 <= self.max_tokens <= self.n_sampled:  # -n 0: not even one token
                return StopReason.LIMIT
            if self.stop_event is not None and self.stop_event.is_set():
                return StopReason.INTERRUPTED
            pos = self.make_room(self.pos, 1)
            if pos is None:
                return StopReason.CTX_FULL
            self.pos = pos
            try:
                token = int(self.sample(self.logits))
            except ModelOutputError as e:  # damaged weights: say which model and where
                raise ModelOutputError(_output_error(self.ctx, e, self.pos)) from None
            if self.is_eog is not None and self.is_eog(token):
                return StopReason.EOG
            self.n_sampled += 1
            yield Step(token, self.logits, self.n_sampled - 1)
            if 0 <= self.max_tokens <= self.n_sampled:
                return StopReason.LIMIT  # before decoding a token nobody will sample from
            if self.is_last is not None and self.is_last():
                return StopReason.EOG  # only an end token could follow (a grammar that is complete)
            try:
                self.logits = self._decode(token)
            except Interrupted:
                return StopReason.INTERRUPTED
            self.pos += 1
            self.n_decoded += 1
            if self.on_decoded is not None:
                self.on_decoded(token, self.logits)


def _output_error(ctx, e, pos: int) -> str:
    """The sampler's refusal of unusable logits, with the model's file name and the position
    whose logits they were (the one the token would take): one line."""
    path = getattr(getattr(ctx, "model", None), "path", None)
    where = f"{path.name}: " if path is not None else ""
    return f"{where}{e} (logits for position {pos})"


def generate(
    ctx,
    sample: Callable[[np.ndarray], int],
    *,
    prompt: Sequence[int] = (),
    logits: Optional[np.ndarray] = None,
    pos0: int = 0,
    seq: int = 0,
    max_tokens: int = -1,
    is_eog: Optional[Callable[[int], bool]] = None,
    stop_event=None,
    make_room: Optional[Callable[[int, int], Optional[int]]] = None,
    on_decoded: Optional[Callable[[int, np.ndarray], None]] = None,
    batch_factory: Optional[Callable] = None,
    is_last: Optional[Callable[[], bool]] = None,
) -> Generation:
    """Generate tokens on sequence `seq`: sample, yield, decode, repeat.

    Start from `prompt` (decoded first at pos0, in n_batch pieces) or, when the caller has
    prefilled already, from the `logits` after its last token (then pos0 = the next position).
    sample(logits f32 [n_vocab]) -> token id: a Sampler with its history bound, or any source.
    max_tokens: most tokens yielded (-1: no limit). is_eog(token): True ends the generation
    (StopReason.EOG) without yielding that token. stop_event (threading.Event): set = stop
    before the next token. make_room(pos, n) -> the position to decode at, or None when the
    sequence cannot take n more tokens (default: stop at n_ctx); a context-shift policy moves
    the sequence down and returns the lower position. on_decoded(token, logits) follows each decode.
    is_last(): asked after each yielded token; True ends the generation there (StopReason.EOG,
    the token not decoded): a grammar after which only an end token could come.
    Interrupted while decoding the prompt propagates (nothing was generated); during generation
    it ends the loop with StopReason.INTERRUPTED.
    """
    if len(prompt):
        logits = decode_tokens(ctx, prompt, pos0, seq, batch_factory=batch_factory)
        pos0 += len(prompt)
    if logits is None:
        raise ValueError("generate: give a prompt or the logits to start from")
    return Generation(
        ctx, sample, logits, pos0, seq, max_tokens, is_eog, stop_event, make_room, on_decoded, batch_factory, is_last
    )


def warm_up(ctx, token: int, seq: int = 0, n_prompt: int = 2) -> None:
    """Run the prompt path (n_prompt tokens) and the generation path (1 token) once, then remove
    them, so numba compiles its kernels here rather than inside the first answer. Small batches
    run the kernels' serial twins and large ones their parallel twins (kernels/parallel.py), so
    a first run (empty numba cache) warms up with a prompt past every threshold (64 tokens)
    and a warm one with 2 tokens: its kernels only load from the cache, whatever the prompt."""
    n_prompt = max(1, min(int(n_prompt), ctx.n_ctx_seq - 1))
    try:
        decode_tokens(ctx, [token] * n_prompt, 0, seq, logits="none")
        decode_one(ctx, token, n_prompt, seq)  # the generation path
    except (Interrupted, DecodeError):
        pass  # a refused warm-up costs only the compile it would have saved
    finally:
        if not ctx.memory.seq_rm(seq, -1, -1):
            ctx.memory.clear(True)
