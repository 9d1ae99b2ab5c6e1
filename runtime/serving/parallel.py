"""Many sequences in one Context: alternatives of one prompt and continuous batching of many.

Both are llama.cpp programs re-made on the memory's sequence operations:
- `alternatives` (llama-batched): the prompt is decoded once with every sequence id on each of
  its tokens (the cells are shared, nothing is copied; with one stream per sequence the prompt is
  decoded for sequence 0 and `seq_cp`'d, which copies the stream), then each step is one
  `decode()` carrying one token of every live sequence.
- `ParallelRunner.run` (llama-parallel / llama-server's slots): up to n_parallel requests live at
  once, each in its own sequence. A shared token prefix (a system prompt) is decoded once into a
  holder sequence and `seq_cp`'d to every newcomer. Each step carries one token of every
  generating sequence plus a chunk of the prompts still being prefilled (at most `prefill_budget`
  tokens, shared fairly among them), so running sequences keep producing while a newcomer's long
  prompt is processed and a short newcomer starts producing before a long one has finished. A
  finished sequence frees its cells (`seq_rm`) and the next request takes its place.

Each sequence has its own Sampler seeded per request, its own grammar matcher when the answers
are constrained (runtime/grammar/; a request may bring its own schema), and its own history (prompt + answer) for
the repetition penalty, and stops exactly where `Conversation` would (end of generation, -n, the
context), so its text is the one a solo run gives for the same logits. The logits are the same
bits as a solo run's: with one stream per sequence it occupies a solo run's cells; in a unified
cache, where its cells are interleaved with the others', attention reads them through a position
view (runtime/memory/kv_view.py, docs/parallel.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvchat.runtime.batch import Batch
from kvchat.runtime.sampling import Sampler, SamplingParams


@dataclass
class Request:
    """One prompt to answer. ids: its tokens (None when it could not be read: then `error`)."""

    index: int
    ids: list[int] | None
    seed: int = 0
    label: str = ""  # the input, for per-request report lines
    error: str | None = None
    constraint: object = None  # a runtime.grammar Constraint of its own (None: the runner's)


@dataclass
class Result:
    index: int
    seed: int
    text: str = ""
    n_prompt: int = 0  # prompt tokens (the shared prefix included)
    n_gen: int = 0  # tokens sampled into the answer
    stop: str = ""  # "eog" | "limit" | "ctx_full" | "interrupted" | "error"
    error: str | None = None
    ids: list[int] = field(default_factory=list)  # answer token ids
    n_reused: int = 0  # prompt tokens not decoded for this request (shared prefix)
    t_prompt: float = 0.0
    t_gen: float = 0.0
    seq_id: int = -1
    step_admitted: int = -1  # decode step at which the request got a sequence
    step_first: int = -1  # decode step whose logits gave its first answer token
    label: str = ""
    logits: object = None  # f32 [n_vocab] after its last decoded token (continue_alternatives)
    reasoning: str | None = None  # its thinking text (None: the model has no thinking markers)

    def json(self) -> dict:
        d = {
            "index": self.index,
            "seed": self.seed,
            "text": self.text,
            "n_prompt": self.n_prompt,
            "n_gen": self.n_gen,
            "stop": self.stop,
        }
        if self.reasoning is not None:
            d["reasoning"] = self.reasoning
        if self.error:
            d["error"] = self.error
        return d


class _Slot:
    """A live sequence: what is still to be prefilled, its sampler, decoder and answer."""

    def __init__(
        self, seq_id: int, req: Request, sampling: SamplingParams, vocab, step: int, constraint=None, reasoning=None
    ):
        from kvchat.runtime.chat.answer import AnswerStream

        self.seq_id = seq_id
        self.req = req
        params = SamplingParams.from_dict(sampling.to_dict())
        params.seed = req.seed
        self.sampler = Sampler(params)
        constraint = req.constraint if req.constraint is not None else constraint
        self.matcher = constraint.matcher() if constraint is not None else None  # its own grammar state
        parser = reasoning(req.ids) if reasoning is not None else None  # its own thinking span
        self.stream = AnswerStream(vocab, self.matcher, parser)
        self.history: list[int] = []  # tokens of this sequence in the cache, in order
        self.pending: list[int] = []  # prompt tokens still to decode
        self.logits: np.ndarray | None = None
        self.next_tok: int | None = None
        self.res = Result(
            index=req.index, seed=req.seed, n_prompt=len(req.ids), seq_id=seq_id, step_admitted=step, label=req.label
        )
        self.t0 = time.perf_counter()
        self.t_gen0 = 0.0
        self.done = False


class ParallelRunner:
    """Runs requests on sequences 0..n_parallel-1 of `ctx` (holder of a shared prefix: n_parallel)."""

    def __init__(
        self,
        ctx,
        vocab,
        sampling: SamplingParams,
        n_parallel: int,
        n_predict: int = -1,
        ignore_eos: bool = False,
        prefill_budget: int | None = None,
        stop_event=None,
        constraint=None,
        reasoning=None,
    ):
        self.ctx = ctx
        self.vocab = vocab
        self.sampling = sampling
        self.n_parallel = int(n_parallel)
        self.n_predict = int(n_predict)
        self.ignore_eos = bool(ignore_eos)
        self.prefill_budget = int(prefill_budget or ctx.n_ubatch)
        self.stop_event = stop_event
        self.constraint = constraint  # every request's grammar unless it brings its own
        self.reasoning = reasoning  # prompt ids -> a ReasoningParser (None: no thinking markers)
        self.unified = bool(getattr(ctx.cparams, "kv_unified", True))
        eog = sorted(int(t) for t in getattr(vocab, "eog", ()) or ())
        self._eog = np.asarray(eog, dtype=np.int64)
        self.n_steps = 0
        self.n_cache_miss = 0
        self.n_prompt_decoded = 0
        self.n_gen_decoded = 0
        self.shared_prefix: list[int] = []
        self.t_total = 0.0

    # ---- capacity ------------------------------------------------------------------------------

    @property
    def n_ctx_seq(self) -> int:
        """Cells one sequence can hold (the whole cache when unified)."""
        return int(self.ctx.n_ctx if self.unified else self.ctx.n_ctx_seq)

    def check_fits(self, req: Request) -> str | None:
        """Why this request can never run here (None if it can)."""
        if req.error:
            return req.error
        if not req.ids:
            return "the prompt is empty"
        if len(req.ids) + 1 > self.n_ctx_seq:
            return (
                f"the prompt has {len(req.ids)} tokens but a sequence holds at most "
                f"{self.n_ctx_seq} (raise -c{'' if self.unified else ' or lower -np'})"
            )
        return None

    # ---- decoding ------------------------------------------------------------------------------

    def _decode(self, toks, pos, seqs, outs) -> int:
        return self.ctx.decode(Batch(np.asarray(toks, dtype=np.int64), pos=pos, seq_ids=seqs, logits=outs))

    def _prefill_shared(self, ids: list[int], seq_ids: list[int]) -> None:
        """Decode ids at positions 0.. with all of seq_ids on every token (n_batch at a time)."""
        from kvchat.runtime.errors import KvchatError

        n_batch = self.ctx.n_batch
        for i in range(0, len(ids), n_batch):
            part = ids[i : i + n_batch]
            outs = [False] * len(part)
            outs[-1] = True
            rc = self._decode(part, list(range(i, i + len(part))), [list(seq_ids)] * len(part), outs)
            if rc == 2:
                raise KeyboardInterrupt
            if rc != 0:
                raise KvchatError(
                    f"decoding the shared prompt failed (code {rc}: {self.ctx.last_error}); raise -c or lower -np"
                )
            self.n_prompt_decoded += len(part)

    # ---- one request per sequence --------------------------------------------------------------

    def _sample(self, s: _Slot) -> None:
        """Sample s's next token from its logits, or finish it (as Conversation._answer stops)."""
        if self.stop_event is not None and self.stop_event.is_set():
            return self._finish(s, "interrupted")
        if len(s.history) + 1 > self.n_ctx_seq:
            return self._finish(s, "ctx_full")
        logits = s.logits
        if self.ignore_eos and self._eog.size:
            logits = logits.copy()
            logits[self._eog[self._eog < logits.shape[0]]] = -np.inf
        p = s.sampler.params
        hist = s.history if p.repeat_last_n < 0 else (s.history[-p.repeat_last_n :] if p.repeat_last_n else [])
        tok = s.stream.choose(s.sampler, logits, hist)
        if s.res.step_first < 0:
            s.res.step_first = self.n_steps
        if not self.ignore_eos and self.vocab.is_eog(tok):
            return self._finish(s, "eog")
        s.res.n_gen += 1
        s.res.ids.append(tok)
        s.stream.emit(tok)
        if 0 <= self.n_predict <= s.res.n_gen:
            return self._finish(s, "limit")
        if s.stream.is_last():
            return self._finish(s, "eog")  # the grammar can only end: as Conversation stops
        s.next_tok = tok

    def _finish(self, s: _Slot, stop: str) -> None:
        if s.done:
            return
        s.stream.finish()
        s.res.text = s.stream.content
        if s.stream.parser is not None:
            s.res.reasoning = s.stream.reasoning
        s.res.stop = stop
        s.res.t_gen = time.perf_counter() - s.t_gen0 if s.t_gen0 else 0.0
        s.next_tok = None
        s.done = True

    def _admit(self, seq_id: int, req: Request) -> _Slot:
        s = _Slot(seq_id, req, self.sampling, self.vocab, self.n_steps, self.constraint, self.reasoning)
        n_sh = len(self.shared_prefix)
        if n_sh:
            self.ctx.memory.seq_cp(self.n_parallel, seq_id, -1, -1)
            s.history = list(self.shared_prefix)
        s.pending = list(req.ids[n_sh:])
        s.res.n_reused = n_sh
        return s

    def _step(self, live: list[_Slot]) -> None:
        """One decode: a token of every generating slot, then prefill chunks of the others."""
        gen = [s for s in live if s.next_tok is not None]
        fill = [s for s in live if s.pending]
        budget = max(0, min(self.prefill_budget, self.ctx.n_batch - len(gen)))
        chunks = []
        for k, s in enumerate(fill):
            part = s.pending[: max(1, budget // (len(fill) - k))] if budget > 0 else []
            if part:
                budget -= len(part)
                chunks.append((s, part))
        while True:
            toks, pos, seqs, outs, own = [], [], [], [], []
            for s in gen:
                toks.append(s.next_tok)
                pos.append(len(s.history))
                seqs.append([s.seq_id])
                outs.append(True)
                own.append((s, [s.next_tok], True, True))
            for s, part in chunks:
                last = len(part) == len(s.pending)
                n0 = len(s.history)
                toks.extend(part)
                pos.extend(range(n0, n0 + len(part)))
                seqs.extend([[s.seq_id]] * len(part))
                outs.extend([False] * (len(part) - 1) + [last])
                own.append((s, part, last, False))
            if not toks:
                return
            rc = self._decode(toks, pos, seqs, outs)
            if rc == 0:
                break
            if rc == 2:
                for s in live:
                    self._finish(s, "interrupted")
                return
            if rc != 1:
                from kvchat.runtime.errors import KvchatError

                raise KvchatError(f"decode failed (code {rc}: {self.ctx.last_error})")
            # no room: llama-parallel's "cache miss". Retry with half the prompt chunks; when
            # they cannot shrink, end the sequence holding the most cells and retry
            self.n_cache_miss += 1
            if any(len(part) > 1 for _, part in chunks):
                chunks = [(s, part[: max(1, len(part) // 2)]) for s, part in chunks]
                continue
            victim = max(gen + [s for s, _ in chunks], key=lambda s: len(s.history))
            self._finish(victim, "ctx_full")
            self.ctx.memory.seq_rm(victim.seq_id, -1, -1)
            gen = [s for s in gen if s is not victim]
            chunks = [(s, part) for s, part in chunks if s is not victim]
        self.n_steps += 1
        now = time.perf_counter()
        logits = self.ctx.get_logits()  # f32 [n_outputs, n_vocab], outputs in batch order
        row = 0
        for s, part, has_out, is_gen in own:
            s.history.extend(int(x) for x in part)
            if is_gen:
                self.n_gen_decoded += 1
                s.next_tok = None
            else:
                del s.pending[: len(part)]
                self.n_prompt_decoded += len(part)
            if has_out:
                s.logits = np.array(logits[row], dtype=np.float32, copy=True)
                row += 1
                if not is_gen:
                    s.res.t_prompt = now - s.t0
                    s.t_gen0 = now

    def run(self, requests: list[Request], on_result=None, shared_prefix: list[int] | None = None):
        """Answer every request (continuous batching); results in completion order via on_result
        and returned in input order. Requests that cannot run get an error result, the rest go on."""
        t_start = time.perf_counter()
        mem = self.ctx.memory
        self.shared_prefix = list(shared_prefix or [])
        results: dict[int, Result] = {}
        queue = []
        for req in requests:
            why = self.check_fits(req)
            if why is None and len(self.shared_prefix) >= len(req.ids):
                why = "the prompt is no longer than the shared prefix"
            if why is not None:
                res = Result(
                    index=req.index,
                    seed=req.seed,
                    stop="error",
                    error=why,
                    n_prompt=len(req.ids or []),
                    label=req.label,
                )
                results[req.index] = res
                if on_result:
                    on_result(res)
            else:
                queue.append(req)
        if self.shared_prefix and queue:
            self._prefill_shared(self.shared_prefix, [self.n_parallel])
        free = list(range(self.n_parallel))
        live: list[_Slot] = []
        while queue or live:
            while free and queue:
                live.append(self._admit(free.pop(0), queue.pop(0)))
            for s in live:
                if s.logits is not None and not s.pending and not s.done:
                    self._sample(s)
                    s.logits = None
            for s in [s for s in live if s.done]:
                mem.seq_rm(s.seq_id, -1, -1)
                free.append(s.seq_id)
                free.sort()
                live.remove(s)
                results[s.req.index] = s.res
                if on_result:
                    on_result(s.res)
            if self.stop_event is not None and self.stop_event.is_set():
                for req in queue:
                    results[req.index] = Result(
                        index=req.index, seed=req.seed, stop="interrupted", n_prompt=len(req.ids), label=req.label
                    )
                queue = []
            if live and any(not s.done for s in live):
                self._step([s for s in live if not s.done])
        if self.shared_prefix:
            mem.seq_rm(self.n_parallel, -1, -1)
        self.t_total = time.perf_counter() - t_start
        return [results[r.index] for r in requests]


def alternatives(runner: ParallelRunner, ids: list[int], seeds: list[int]) -> list[Result]:
    """llama-batched: one prompt, len(seeds) answers; the prompt decoded once for all of them."""
    n = len(seeds)
    from kvchat.runtime.errors import KvchatError

    if not ids:
        raise KvchatError("the prompt is empty")
    need = len(ids) + (n if runner.unified else 1)
    have = runner.ctx.n_ctx if runner.unified else runner.n_ctx_seq
    if need > have:
        where = f"the context has {have} cells" if runner.unified else f"each of the {n} streams has {have} cells"
        raise KvchatError(
            f"{len(ids)} prompt tokens and {n} sequences need at least {need} cells, {where}; raise -c or lower -np"
        )
    t_start = t0 = time.perf_counter()
    mem = runner.ctx.memory
    if runner.unified:
        runner._prefill_shared(ids, list(range(n)))
    else:
        runner._prefill_shared(ids, [0])
        for i in range(1, n):
            mem.seq_cp(0, i, -1, -1)
    logits = np.array(runner.ctx.get_logits_ith(-1), dtype=np.float32, copy=True)
    out = continue_alternatives(runner, list(range(n)), list(ids), logits, seeds, t_prompt=time.perf_counter() - t0)
    runner.t_total = time.perf_counter() - t_start
    return out


def continue_alternatives(
    runner: ParallelRunner,
    seq_ids: list[int],
    history: list[int],
    logits: np.ndarray,
    seeds: list[int],
    free: bool = True,
    t_prompt: float = 0.0,
) -> list[Result]:
    """Answers on seq_ids, which all hold `history` already; `logits` f32 [n_vocab] follow its
    last token. Answer i is sampled with seeds[i]; with free=False the sequences keep their cells
    (the chat's /alts keeps them until /pick). Each result's `logits` are its last decoded ones."""
    mem = runner.ctx.memory
    now = time.perf_counter()
    live = []
    for i, seq in enumerate(seq_ids):
        req = Request(index=i, ids=list(history), seed=seeds[i])
        s = _Slot(seq, req, runner.sampling, runner.vocab, 0, runner.constraint, runner.reasoning)
        s.history = list(history)
        s.logits = logits
        s.res.t_prompt = t_prompt
        s.t_gen0 = now
        live.append(s)
    out: list[Result] = [None] * len(seq_ids)
    last: dict[int, np.ndarray] = {i: logits for i in range(len(seq_ids))}
    while live:
        for s in live:
            if s.logits is not None and not s.done:
                last[s.req.index] = s.logits
                runner._sample(s)
                s.logits = None
        for s in [s for s in live if s.done]:
            if free:
                mem.seq_rm(s.seq_id, -1, -1)
            live.remove(s)
            s.res.logits = last[s.req.index]
            out[s.req.index] = s.res
        if live:
            runner._step(live)
    return out
