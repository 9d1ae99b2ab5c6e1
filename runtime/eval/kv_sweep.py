"""kv-sweep: every KV cache configuration scored against the f16/f16 reference in one pass.

For each chunk (llama-perplexity's protocol, runtime/eval/perplexity.py) the reference is decoded
once and its scored positions are stored as llama-perplexity's 16-bit log-prob rows, in memory;
then each configuration decodes the same chunk and is scored against those rows with the same
kernel `--kl-divergence` uses. So a configuration's numbers equal the two-pass route's (base
file, then --kl-divergence) while the reference costs one decode per chunk for all of them, and
no logits file is written: long contexts cost memory for one chunk's reference rows only.

Contexts are created per chunk and configuration (cheap: the cache is zero pages until used),
so only one logits buffer is alive at a time whatever the number of configurations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvchat.kernels.ggml_types import cache_type_by_name, row_bytes
from kvchat.kernels.logprob import quantize_log_prob_rows, row_words
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.eval.kld import KLDStats, n_scored
from kvchat.runtime.eval.perplexity import chunk_input, chunk_outputs, make_context

REFERENCE = ("f16", "f16")
N_DEPTH_BINS = 8


@dataclass(frozen=True)
class SweepConfig:
    type_k: str
    type_v: str
    rotation: bool = True  # False: quantized K/V stored without the Hadamard rotation

    @property
    def label(self) -> str:
        return f"{self.type_k}/{self.type_v}" + ("" if self.rotation else " rot off")

    @property
    def quantized(self) -> bool:
        return any(cache_type_by_name(t).block_size != 1 for t in (self.type_k, self.type_v))


def sweep_configs(ks: list[str], vs: list[str], rots: list[bool]) -> list[SweepConfig]:
    """Every (K, V) pair, plus the K-only (V f16) and V-only (K f16) controls, for each rotation
    setting; minus the reference itself and rotation variants of unrotated (float) pairs."""
    pairs = [(k, v) for k in ks for v in vs]
    pairs += [(k, "f16") for k in ks] + [("f16", v) for v in vs]
    out: list[SweepConfig] = []
    for rot in rots:
        for k, v in pairs:
            c = SweepConfig(k, v, rot)
            if (k, v) == REFERENCE or c in out or (not rot and not c.quantized):
                continue
            out.append(c)
    return out


def kv_footprint(hparams, type_k: str, type_v: str, n_ctx: int) -> tuple[int, int]:
    """(bytes one token adds to every KV layer, KV bytes of an n_ctx context with sliding-window
    layers holding their window only)."""
    tk, tv = cache_type_by_name(type_k).type_id, cache_type_by_name(type_v).type_id
    per_token = at_ctx = 0
    n_swa = int(getattr(hparams, "n_swa", 0) or 0)
    for il in range(hparams.n_layer):
        if not hparams.has_kv(il):
            continue
        b = row_bytes(tk, hparams.n_embd_k_gqa(il)) + row_bytes(tv, hparams.n_embd_v_gqa(il))
        per_token += b
        cells = min(n_ctx, n_swa) if n_swa > 0 and hparams.is_swa(il) else n_ctx
        at_ctx += b * cells
    return per_token, at_ctx


@dataclass
class SweepRow:
    config: SweepConfig
    n_ctx: int
    stats: KLDStats = field(default_factory=KLDStats)
    seconds: float = 0.0  # wall time of its decodes and scoring
    cpu_seconds: float = 0.0  # CPU time of the same (all threads): what a busy machine cannot inflate
    state_bytes: int = 0
    session_bytes: int = 0
    speed: dict = field(default_factory=dict)  # llama-bench test name -> t/s

    def depth_profile(self, n_bins: int = N_DEPTH_BINS) -> list[dict]:
        """Mean KLD of the scored positions in n_bins equal ranges of chunk position."""
        depth, kld = self.stats.values("depth"), self.stats.values("kld")
        first, last = self.n_ctx // 2, self.n_ctx - 1
        edges = np.linspace(first, last, n_bins + 1).round().astype(int)
        out = []
        for a, b in zip(edges[:-1], edges[1:]):
            sel = (depth >= a) & (depth < b)
            out.append(
                dict(
                    pos_from=int(a),
                    pos_to=int(b),
                    n=int(sel.sum()),
                    mean_kld=float(kld[sel].mean()) if sel.any() else float("nan"),
                )
            )
        return out

    def as_dict(self, hparams) -> dict:
        per_tok, at_ctx = kv_footprint(hparams, self.config.type_k, self.config.type_v, self.n_ctx)
        d = dict(
            type_k=self.config.type_k,
            type_v=self.config.type_v,
            rot="auto" if self.config.rotation else "off",
            n_ctx=self.n_ctx,
        )
        d.update(self.stats.summary())
        d.update(
            kv_bytes_per_token=per_tok,
            kv_bytes_per_token_at_ctx=at_ctx / self.n_ctx,
            kv_mib_at_ctx=at_ctx / 2**20,
            state_bytes=self.state_bytes,
            session_bytes=self.session_bytes,
            seconds=self.seconds,
            cpu_seconds=self.cpu_seconds,
        )
        d.update({k: v for k, v in self.speed.items()})
        d["kld_by_depth"] = self.depth_profile()
        return d


def paired_difference(a: KLDStats, b: KLDStats) -> dict:
    """Mean KLD(a) - KLD(b) over the same tokens with a 95 % interval (normal approximation,
    tokens taken as independent, as llama-perplexity's ± does)."""
    x, y = a.values("kld").astype(np.float64), b.values("kld").astype(np.float64)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("paired comparison needs the same scored tokens")
    d = x - y
    m, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    return dict(mean_diff=m, ci95_lo=m - 1.96 * se, ci95_hi=m + 1.96 * se, differ=bool(abs(m) > 1.96 * se))


def run_sweep(
    model,
    tokens,
    configs: list[SweepConfig],
    n_ctx: int,
    n_chunks: int = -1,
    n_batch: int = 512,
    n_ubatch: int = 512,
    n_threads: Optional[int] = None,
    flash_attn: str = "on",
    on_step: Optional[Callable[[str], None]] = None,
    state_size: Optional[Callable[[object, np.ndarray], tuple[int, int]]] = None,
) -> tuple[SweepRow, list[SweepRow]]:
    """Score `configs` against the f16/f16 reference (flash attention on) in lockstep, chunk by
    chunk. Returns the reference's row (its KLD against itself is the 16-bit rounding of the
    stored rows) and one row per configuration (flash attention `flash_attn`).
    on_step(label) is called after each decode of a chunk (for a progress bar); state_size(ctx,
    chunk) -> (state bytes, session bytes) is asked once per configuration after its last chunk."""
    n_have = len(tokens) // n_ctx
    if n_have < 1:
        raise KvchatError(
            f"the text tokenizes to {len(tokens)} tokens, fewer than one chunk of "
            f"-c {n_ctx}; give a longer -f text or a smaller -c"
        )
    n_chunk = n_have if n_chunks < 0 else min(n_chunks, n_have)
    tokens = np.asarray(tokens, dtype=np.int64)
    first, k = n_ctx // 2, n_scored(n_ctx)
    n_vocab = int(model.hparams.n_vocab)
    rows = [SweepRow(c, n_ctx) for c in configs]
    ref_row = SweepRow(SweepConfig(*REFERENCE), n_ctx)
    ref = np.empty((k, row_words(n_vocab)), dtype=np.uint16)  # the reference rows of one chunk

    def ctx_for(tk, tv, rot, fa="on"):
        return make_context(model, n_ctx, n_batch, n_ubatch, tk, tv, fa, n_threads, rot)

    for i in range(n_chunk):
        chunk = chunk_input(model, tokens, i, n_ctx)
        t0, c0 = time.perf_counter(), time.process_time()
        ctx = ctx_for(*REFERENCE, True)
        for pos, logits in chunk_outputs(ctx, chunk, first, i):
            lo, hi = int(pos[0]) - first, int(pos[-1]) - first + 1
            targets = tokens[i * n_ctx + pos + 1]
            quantize_log_prob_rows(logits, targets, ref[lo:hi], np.empty(hi - lo))
            ref_row.stats.add_rows(logits, ref[lo:hi], targets, pos)
        ref_row.seconds += time.perf_counter() - t0
        ref_row.cpu_seconds += time.process_time() - c0
        if i == n_chunk - 1 and state_size is not None:
            ref_row.state_bytes, ref_row.session_bytes = state_size(ctx, chunk)
        ctx = logits = None
        if on_step:
            on_step(f"chunk {i + 1}/{n_chunk} reference")
        for row in rows:
            c = row.config
            t0, c0 = time.perf_counter(), time.process_time()
            ctx = ctx_for(c.type_k, c.type_v, c.rotation, flash_attn)
            for pos, logits in chunk_outputs(ctx, chunk, first, i):
                lo, hi = int(pos[0]) - first, int(pos[-1]) - first + 1
                row.stats.add_rows(logits, ref[lo:hi], tokens[i * n_ctx + pos + 1], pos)
            row.seconds += time.perf_counter() - t0
            row.cpu_seconds += time.process_time() - c0
            if i == n_chunk - 1 and state_size is not None:
                row.state_bytes, row.session_bytes = state_size(ctx, chunk)
            ctx = logits = None
            if on_step:
                on_step(f"chunk {i + 1}/{n_chunk} {c.label}")
    return ref_row, rows


def measure_speed(
    model, config: SweepConfig, n_pp: int, n_tg: int, depth: int, n_threads: Optional[int] = None, seed: int = 1234
) -> dict:
    """llama-bench's pp / tg tests on this configuration, one timed run each after an untimed
    warm-up: {"pp512": t/s, "tg128 @ d383": t/s} (tg: n_tg timed tokens after `depth` cached
    ones and one untimed token). Random tokens, as llama-bench uses."""
    from kvchat.runtime.generate import DecodeError, decode_tokens

    rng = np.random.default_rng(seed)
    n_vocab = int(model.hparams.n_vocab)
    out = {}
    n_ctx = max(n_pp, depth + n_tg) + 1
    ctx = make_context(model, n_ctx, 512, 512, config.type_k, config.type_v, "on", n_threads, config.rotation)

    def fill(toks, pos0):
        try:
            decode_tokens(ctx, toks, pos0, 0, logits="none")
        except DecodeError as e:
            raise KvchatError(f"speed test of {config.label}: {e}") from None

    if n_pp > 0:
        for timed in (False, True):  # the first run compiles and touches the weights
            ctx.memory.clear(True)
            toks = rng.integers(0, n_vocab, n_pp)
            t0 = time.perf_counter()
            fill(toks, 0)
            if timed:
                out[f"pp{n_pp}"] = n_pp / (time.perf_counter() - t0)
    if n_tg > 0:
        ctx.memory.clear(True)
        if depth:
            fill(rng.integers(0, n_vocab, depth), 0)
        toks = rng.integers(0, n_vocab, n_tg + 1)
        fill(toks[:1], depth)  # an untimed first token (one-token kernels)
        t0 = time.perf_counter()
        for j in range(1, n_tg + 1):
            fill(toks[j : j + 1], depth + j)
        out[f"tg{n_tg}" + (f" @ d{depth}" if depth else "")] = n_tg / (time.perf_counter() - t0)
    return out
