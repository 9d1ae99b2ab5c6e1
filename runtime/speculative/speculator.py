"""What a speculative run keeps between verify batches: the draft source, how many tokens to
draft next (DraftLength), and the counts `/stats` shows (SpecStats).

The draft length follows a cost model, so that bad drafts cost (almost) nothing: with a
per-token acceptance probability p, a verify of the sampled token and k drafts yields
1 + p + ... + p^k tokens on average and costs t(k + 1) + k·t_draft, where t(n) is the target's
time for an n-token batch (measured: t(1) + (n - 1)·t_row, fitted from the batches seen) and
t_draft the draft source's time per token (measured; ~0 for n-gram lookups; a draft model's one-token
decodes: its catch-up on a backlog — the prompt, the tokens of plain steps — is one batch, not a
draft step, and is not counted). k is the value in
0..draft_max with the most tokens per second; below draft_min it is 0 (a plain one-token step),
and after PROBE_EVERY plain steps a draft of draft_min (at least 2, one of them a model draft's
step) is tried again, so that the estimates can recover (the wait doubles after each probe that
does not pay, up to PROBE_MAX; HOPELESS_WAIT while a draft step costs so much that even accepted
drafts would lose, as a q4_0 self-draft of SmolLM2's Q8_0 copy does here).
A model draft may propose nothing (it is unsure of the next token, --draft-p-min): a share
1 - q of the proposals then costs a draft step and a plain step for one token, and the rate of a
k is (q·gain(k) + 1 - q) / (q·(t(k + 1) + k·t_draft) + (1 - q)·(t(1) + t_draft)).
p and q are counted with decay (recent drafts weigh most). Both times are medians of their last N_TIMES
measurements: on a shared machine one step can take 3x (a descheduled thread), and a mean seeded
by such a probe kept a run from drafting for its remaining few hundred tokens (a Gemma-3 F16 copy
with self:q4_0 at 0.73x plain in one run, 1.66x in the next).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

DRAFT_MAX = 16  # --draft-max's default: most drafts per verify (llama.cpp's default too)
DRAFT_P_MIN = 0.5  # --draft-p-min's default: a model draft stops at a token it gives less (llama.cpp: 0)
PROBE_EVERY = 16  # plain steps before a probing draft when drafting does not pay (doubles per probe)
PROBE_MAX = 64  # ... up to this many: a model draft's probe first catches up on every skipped token (one
# batch, ~1/20 of the plain steps' time on Gemma-3 here), so a wrong "does not pay" lasts 64 tokens at most
DECAY = 0.9  # weight of the past in the acceptance counts (per verify)
N_TIMES = 9  # target decode times kept per batch size, draft times per token (their medians are the estimates)
HOPELESS_WAIT = 512  # plain steps between probes while drafting would lose even fully accepted
MIN_DRAFT_SAMPLES = 3  # draft-step times before that can be concluded


@dataclass
class SpecStats:
    """Counts of a speculative run: tokens drafted, accepted, verify batches."""

    n_drafted: int = 0
    n_accepted: int = 0
    n_verify: int = 0

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    def add(self, other: "SpecStats") -> None:
        self.n_drafted += other.n_drafted
        self.n_accepted += other.n_accepted
        self.n_verify += other.n_verify


class DraftLength:
    """The number of tokens to draft next, from measured acceptance and costs (module docstring)."""

    def __init__(self, draft_max: int = DRAFT_MAX, draft_min: int = 0, probe_max: int = PROBE_MAX):
        """probe_max: the longest wait between probes while drafting does not pay (PROBE_MAX for a
        source whose probe first catches up on the skipped tokens; PROBE_EVERY, no backing off, for
        one whose probe costs its draft steps only: a SelfDraft)."""
        if draft_max < 0 or draft_min < 0 or draft_min > draft_max:
            raise ValueError(f"draft lengths: need 0 <= draft-min ({draft_min}) <= draft-max ({draft_max})")
        self.draft_max, self.draft_min = int(draft_max), int(draft_min)
        self.probe_max = int(probe_max)
        self.acc, self.trials = 1.0, 2.0  # prior p = 0.5 (pseudo-counts)
        # proposals that drafted something, of those asked for (a model draft proposes nothing when
        # it is unsure of the first token, --draft-p-min): prior 1 (pseudo-counts)
        self.made, self.asked = 2.0, 2.0
        self.t_size: dict[int, float] = {}  # batch size n -> median seconds of a target decode of n tokens
        self._times: dict[int, deque] = {}  # batch size n -> its last N_TIMES decode times
        self.t_draft = 0.0  # median seconds per drafted token over the last N_TIMES proposals
        self._draft_times: deque = deque(maxlen=N_TIMES)
        self._draft_warm = False
        self.n_plain = 0  # plain steps since the last draft
        self.probe_every = PROBE_EVERY  # plain steps before the next probe

    @property
    def q(self) -> float:
        """The share of proposals that drafted at least one token (decayed counts)."""
        return self.made / self.asked

    @property
    def p(self) -> float:
        return min(0.99, self.acc / self.trials)

    def _line(self, min_samples: int = 1):
        """n -> estimated seconds of an n-token target decode: a line through the medians of the
        sizes measured at least min_samples times (fitted once, evaluated for every draft length).
        Theil-Sen (the median of the pairwise slopes, then the median intercept): a size timed once
        while the machine stalled must not tilt the line — a least-squares fit through one such
        17-token verify (a self-draft asks for --draft-max) made every draft look dear."""
        pts = sorted((m, t) for m, t in self.t_size.items() if len(self._times[m]) >= min_samples)
        if not pts:
            return lambda n: 1.0 + 0.15 * (n - 1)  # before any measurement: only ratios matter
        if len(pts) == 1:
            (m, t) = pts[0]
            one = t / (1.0 + 0.15 * (m - 1))
            return lambda n: one * (1.0 + 0.15 * (n - 1))
        slopes = [(tj - ti) / (mj - mi) for i, (mi, ti) in enumerate(pts) for mj, tj in pts[i + 1 :]]
        slope = max(0.0, statistics.median(slopes))
        base = statistics.median(t - slope * m for m, t in pts)
        return lambda n: max(1e-6, base + slope * n)

    def next(self) -> int:
        """How many tokens to draft for the next verify."""
        p, q = self.p, self.q
        t_draft = self.t_draft if self.t_size else 0.0  # seconds only mean something next to measured t(n)
        t = self._line()
        best, best_rate = 0, 1.0 / t(1)
        gain = 1.0
        for k in range(1, self.draft_max + 1):
            gain += p**k
            # a share 1 - q of the proposals is empty: one draft step, then a plain step
            rate = (q * gain + 1.0 - q) / (q * (t(k + 1) + k * t_draft) + (1.0 - q) * (t(1) + t_draft))
            if rate > best_rate:
                best, best_rate = k, rate
        if best < max(1, self.draft_min):
            self.n_plain += 1
            if self.n_plain >= self.probe_every:
                self.n_plain = 0
                if self.probe_every < HOPELESS_WAIT and self.hopeless():
                    self.probe_every = HOPELESS_WAIT  # then one probe, whatever the estimates say
                    return 0
                self.probe_every = min(self.probe_max, 2 * self.probe_every)  # each failed probe waits longer
                # two drafts: a model draft's second one is a draft step, the sample of its cost
                return max(min(2, self.draft_max), self.draft_min)
            return 0
        self.n_plain = 0
        self.probe_every = PROBE_EVERY
        return best

    def hopeless(self) -> bool:
        """Would drafting lose even if every draft were accepted? Then a probe (which first
        catches a draft model up on the skipped tokens: ~9 % of their plain steps for SmolLM2's
        q4_0 self-draft) cannot pay. True only on MIN_DRAFT_SAMPLES draft-step times and as many
        one-token target decodes."""
        if len(self._draft_times) < MIN_DRAFT_SAMPLES or len(self._times.get(1, ())) < MIN_DRAFT_SAMPLES:
            return False
        # medians of sizes timed MIN_DRAFT_SAMPLES times: one verify stretched by a busy machine must
        # not stop drafting for HOPELESS_WAIT steps (with only one-token times, the prior slope)
        t = self._line(MIN_DRAFT_SAMPLES)
        plain = 1.0 / t(1)
        return all((k + 1) / (t(k + 1) + k * self.t_draft) <= plain for k in range(1, self.draft_max + 1))

    def record_decode(self, n: int, seconds: float) -> None:
        """A target decode of n tokens took `seconds`. t_size[n] is the median of the last
        N_TIMES: a step that waited for a descheduled worker (the launch tuner probing its
        parallel arm under load costs 3x) must not move the estimate."""
        last = self._times.get(n)
        if last is None:  # the first batch of a size loads its kernels' code paths: not a sample
            self._times[n] = deque(maxlen=N_TIMES)
            return
        last.append(seconds)
        self.t_size[n] = statistics.median(last)

    def record_draft(
        self, n_drafted: int, n_accepted: int, rejected: bool, seconds: float, n_steps: int | None = None
    ) -> None:
        """A proposal of n_drafted tokens, of which the first n_accepted were accepted (`rejected`:
        the next one was not; False when all were, or the run stopped); its n_steps draft steps
        (n_drafted when None) took `seconds` (none: no sample of a step's cost). An empty proposal
        (n_drafted 0) counts toward q only."""
        self.made = DECAY * self.made + (1 if n_drafted else 0)
        self.asked = DECAY * self.asked + 1
        if n_drafted:
            self.acc = DECAY * self.acc + n_accepted
            self.trials = DECAY * self.trials + n_accepted + (1 if rejected else 0)
        n_steps = n_drafted if n_steps is None else n_steps
        if n_steps and not self._draft_warm:
            self._draft_warm = True  # the first draft steps load the draft's kernels: not a sample
        elif n_steps:
            self._draft_times.append(seconds / n_steps)
            self.t_draft = statistics.median(self._draft_times)


class Speculator:
    """A draft source with its draft length and counts; one per conversation (or bench run).
    source: anything with propose(history, n_max, pos, seq) -> list[int] and close() (pos, seq:
    where the target's memory will hold history's last token, which it does not hold yet)."""

    def __init__(self, source, draft_max: int = DRAFT_MAX, draft_min: int = 0):
        self.source = source
        self.length = DraftLength(draft_max, draft_min, getattr(source, "probe_max", PROBE_MAX))
        self.stats = SpecStats()  # the whole run's

    @property
    def name(self) -> str:
        return getattr(self.source, "name", type(self.source).__name__)

    def close(self) -> None:
        self.source.close()
