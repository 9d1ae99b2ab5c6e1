"""Token sampling: the sampler chain of llama.cpp's default CLI setup, on numpy.

The chain turns one row of logits into one token id, in this fixed order:
repetition penalty → grammar mask → top-k → top-p → min-p → temperature → draw. Each step narrows or reshapes a
list of candidates (ids sorted by falling logit); the draw at the end is the only random step and
uses a seeded ``numpy.random.Generator``, so a given seed reproduces a run exactly. The grammar
mask (`allowed`, from runtime/grammar/matcher.py) keeps only the tokens a grammar allows before
any filter runs, so top-k and the rest choose among valid tokens and the draw stays one uniform
number per token, as llama.cpp places its grammar sampler ahead of the chain's filters. A temperature
of 0 (or below) keeps only the most likely candidate: greedy decoding, ties going to the lowest id.

The sampler keeps no token history of its own: callers pass the recent tokens (the tail of the
sequence held in the cache), so regenerating or undoing an answer never leaves stale penalties.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, fields

import numpy as np

MIN_KEEP = 1  # every filter keeps at least this many candidates


@dataclass
class SamplingParams:
    """User-facing sampling settings; defaults are llama.cpp's."""

    temp: float = 0.8
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # 0: off, -1: the whole history passed in
    seed: int | None = None  # None: a random seed, chosen once per Sampler

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Reject values no sampler can use (user input: one-line ValueError)."""
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat-penalty must be > 0 (got {self.repeat_penalty})")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat-last-n must be -1, 0 or positive (got {self.repeat_last_n})")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min-p must be within 0..1 (got {self.min_p})")
        if self.top_p < 0.0:
            raise ValueError(f"top-p must be >= 0 (got {self.top_p})")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise ValueError(f"seed must be within 0..2^64-1 (got {self.seed})")


# ---- the chain steps; each takes and returns (ids i64 [n], logits f64 [n]) ---------------------


def apply_repetition_penalty(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    """Penalise every token id seen in `recent` once: positive logits divided, negative multiplied.

    logits f32/f64 [n_vocab] → a new f64 [n_vocab] array (the input is never modified).
    """
    out = np.array(logits, dtype=np.float64, copy=True)  # [n_vocab] f64
    if penalty == 1.0 or recent is None or len(recent) == 0:
        return out
    ids = np.unique(np.asarray(recent, dtype=np.int64))  # [n_unique] i64
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    v = out[ids]
    out[ids] = np.where(v <= 0.0, v * penalty, v / penalty)
    return out


def top_k(ids: np.ndarray, logits: np.ndarray, k: int):
    """Keep the k highest logits, sorted by falling logit (ties: lower id first).

    k <= 0 keeps every candidate (still sorted, which the later steps rely on).
    """
    n = logits.shape[0]
    if 0 < k < n:
        part = np.argpartition(-logits, k - 1)[:k]  # [k] unsorted, may split ties arbitrarily
        kth = logits[part].min()
        # include every candidate tied with the k-th so the id tie-break below is well defined
        part = np.nonzero(logits >= kth)[0]
        ids, logits = ids[part], logits[part]
    order = np.lexsort((ids, -logits))  # primary: logit desc, secondary: id asc
    ids, logits = ids[order], logits[order]
    if 0 < k < ids.shape[0]:
        ids, logits = ids[:k], logits[:k]
    return ids, logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax in f64; -inf logits get probability 0."""
    m = np.max(logits)
    e = np.exp(logits - m)
    return e / e.sum()


def top_p(ids: np.ndarray, logits: np.ndarray, p: float, min_keep: int = MIN_KEEP):
    """Keep the smallest prefix (of sorted candidates) whose probability mass reaches p."""
    if p >= 1.0 or ids.shape[0] <= min_keep:
        return ids, logits
    cum = np.cumsum(softmax(logits))
    n_keep = int(np.searchsorted(cum, p, side="left")) + 1  # first index where cum >= p, inclusive
    n_keep = max(min_keep, min(n_keep, ids.shape[0]))
    return ids[:n_keep], logits[:n_keep]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float, min_keep: int = MIN_KEEP):
    """Keep candidates whose probability is at least p times that of the most likely one."""
    if p <= 0.0 or ids.shape[0] <= min_keep:
        return ids, logits
    threshold = logits.max() + np.log(p)  # p_i >= p * p_max  <=>  l_i >= l_max + ln p
    keep = logits >= threshold
    if keep.sum() < min_keep:
        keep[:min_keep] = True  # sorted: the first ones are the largest
    return ids[keep], logits[keep]


def temperature(ids: np.ndarray, logits: np.ndarray, temp: float):
    """Scale logits by 1/temp; temp <= 0 keeps only the best candidate (greedy)."""
    if temp <= 0.0:
        best = int(np.argmax(logits))  # first maximum: candidates are sorted, ties by id
        return ids[best : best + 1], logits[best : best + 1]
    return ids, logits / temp


# ---- the chain ---------------------------------------------------------------------------------


def check_logits(logits: np.ndarray) -> None:
    """ModelOutputError unless the logits can be sampled: no NaN, no +inf, not all -inf.

    -inf alone is fine (masked tokens, --ignore-eos); the rest only comes from damaged weights,
    and sampling it would pick token 0 forever or fail deep inside argmax."""
    from kvchat.runtime.errors import ModelOutputError

    x = np.asarray(logits)
    if x.size and np.isfinite(x).all():
        return
    if x.size == 0:
        raise ModelOutputError("the model produced no logits")
    if np.isnan(x).any():
        raise ModelOutputError(
            "the model produced NaN logits: its weights are damaged (re-download or re-convert the model file)"
        )
    if np.isposinf(x).any():
        raise ModelOutputError(
            "the model produced infinite logits: its weights are damaged (re-download or re-convert the model file)"
        )
    if not np.isfinite(x).any():
        raise ModelOutputError("every token has probability zero (all logits are -inf)")


class Sampler:
    """The sampler chain plus its random generator. One per conversation."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.params.validate()
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(32)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def reseed(self, seed: int | None) -> None:
        """Restart the random stream (a fixed seed, or a fresh random one for None)."""
        self.params.seed = seed
        self.seed = seed if seed is not None else secrets.randbits(32)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def _recent(self, history):
        n = self.params.repeat_last_n
        if history is None or n == 0:
            return ()
        return history if n < 0 else history[-n:]

    def candidates(self, logits: np.ndarray, history=None, allowed=None):
        """Run every filter of the chain; return (ids i64 [n], probs f64 [n]) to draw from.

        logits f32 [n_vocab]; history: token ids of the sequence so far (oldest first);
        allowed: bool [n_vocab] of the tokens a grammar allows (None: every token).
        """
        check_logits(logits)
        p = self.params
        penalised = apply_repetition_penalty(logits, self._recent(history), p.repeat_penalty)
        n = penalised.shape[0]
        if allowed is None:
            ids = np.arange(n, dtype=np.int64)  # [n_vocab] i64
        else:
            # penalised is this call's own copy: the refused tokens go to -inf in place (putmask:
            # ~3x cheaper than np.where here); -inf already there (--ignore-eos) stays out too
            np.putmask(penalised, ~np.asarray(allowed, dtype=bool)[:n], -np.inf)
            ok = np.isfinite(penalised)  # [n_vocab] bool
            n_ok = int(np.count_nonzero(ok))
            if n_ok == 0:
                from kvchat.runtime.errors import ModelOutputError

                raise ModelOutputError("the grammar allows no token the model can produce here")
            if 0 < p.top_k <= n_ok:
                # the k best allowed tokens are the k best of the whole row with the others at
                # -inf (at least k are finite): the same candidates, in the same order, without
                # gathering a permissive mask's ~n_vocab ids and logits
                ids = np.arange(n, dtype=np.int64)  # [n_vocab] i64
            else:
                ids = np.flatnonzero(ok).astype(np.int64)  # [n_ok] i64
                penalised = penalised[ids]  # [n_ok] f64
        ids, lg = top_k(ids, penalised, p.top_k)
        ids, lg = top_p(ids, lg, p.top_p)
        ids, lg = min_p(ids, lg, p.min_p)
        ids, lg = temperature(ids, lg, p.temp)
        return ids, softmax(lg)

    def sample(self, logits: np.ndarray, history=None, allowed=None) -> int:
        """Draw one token id from `logits` f32 [n_vocab] (among `allowed`, bool [n_vocab], if given)."""
        ids, probs = self.candidates(logits, history, allowed)
        if ids.shape[0] == 1:
            return int(ids[0])
        u = self.rng.random()  # one uniform draw per token keeps streams reproducible
        i = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(ids[min(i, ids.shape[0] - 1)])
