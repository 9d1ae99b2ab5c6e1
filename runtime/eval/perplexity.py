"""llama-perplexity's protocol on our engine: perplexity, base files, KL divergence.

Protocol (tools/perplexity/perplexity.cpp): tokenize the whole file (BOS if the model adds
one), cut n_tokens // n_ctx chunks of n_ctx tokens; for each chunk clear the memory, put BOS
in place of its first token when the model adds BOS, decode it in n_batch batches, and score
the second half: the logits at position i (n_ctx/2 <= i < n_ctx - 1) give -log p(token i+1).
PPL = exp(mean NLL); its uncertainty is the standard error of the mean NLL times PPL.

Only the scored positions are outputs (as llama-perplexity flags them), so the output matrix
runs on half the tokens. The same chunk loop serves three jobs: plain perplexity, writing a
base file (`base_out`, the 16-bit log-prob rows llama-perplexity writes) and scoring against
one (`kl_base`, KLD statistics per token). kv-sweep (runtime/eval/kv_sweep.py) drives several
contexts through `chunk_outputs` in lockstep.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np

from kvchat.kernels.logprob import nll_rows, quantize_log_prob_rows, row_words
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.eval.kld import KLDStats, LogitsFile, LogitsFileWriter, n_scored


@dataclass
class PerplexityResult:
    running: list[float] = field(default_factory=list)  # PPL after each chunk
    ppl: float = float("nan")
    stderr: float = float("nan")
    n_scored: int = 0
    seconds: float = 0.0
    kld: Optional[KLDStats] = None  # set when scored against a base file


def make_context(
    model,
    n_ctx: int,
    n_batch: int = 512,
    n_ubatch: int = 512,
    type_k: str = "f16",
    type_v: str = "f16",
    flash_attn: str = "on",
    n_threads: Optional[int] = None,
    rotation: bool = True,
):
    """A one-sequence context for chunked scoring. rotation=False stores quantized K/V without
    the Hadamard rotation (llama.cpp's LLAMA_ATTN_ROT_DISABLE), to measure what it buys."""
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.errors import CParamsError

    n_batch = min(n_batch, n_ctx)
    try:
        ctx = Context(
            model,
            ContextParams(
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=min(n_ubatch, n_batch),
                type_k=type_k,
                type_v=type_v,
                flash_attn=flash_attn,
                n_threads=n_threads,
            ),
        )
    except CParamsError as e:
        raise KvchatError(str(e)) from None
    if not rotation:
        for kv in ctx.memory.kv_caches():
            kv.n_rot_k = kv.n_rot_v = 0
    return ctx


def check_length(n_tokens: int, n_ctx: int) -> None:
    if n_tokens < 2 * n_ctx:
        raise KvchatError(
            f"the text tokenizes to only {n_tokens} tokens; perplexity with a "
            f"context of {n_ctx} needs at least {2 * n_ctx} (use a smaller -c or a "
            f"longer -f text)"
        )


def chunk_input(model, tokens, i: int, n_ctx: int) -> np.ndarray:
    """i64 [n_ctx]: chunk i's tokens as decoded (first token replaced by BOS if the model adds one)."""
    chunk = np.array(tokens[i * n_ctx : (i + 1) * n_ctx], dtype=np.int64)
    if model.vocab.add_bos:
        chunk[0] = model.vocab.bos
    return chunk


def chunk_outputs(ctx, chunk: np.ndarray, first: int, i_chunk: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Decode one chunk into a cleared memory (kvchat.runtime.generate.decode_pieces, only the scored
    positions as outputs); after each batch that has scored positions yield (positions i64 [m],
    logits f32 [m, n_vocab]) for positions first <= p < n_ctx - 1. The logits are the context's
    buffer: use them before advancing the iterator."""
    from kvchat.runtime.generate import DecodeError, decode_pieces

    n_ctx = chunk.shape[0]
    ctx.memory.clear(True)
    pos = np.arange(n_ctx, dtype=np.int64)
    try:
        yield from decode_pieces(ctx, chunk, 0, 0, outputs=(pos >= first) & (pos < n_ctx - 1))
    except DecodeError as e:
        raise KvchatError(f"decode failed on chunk {i_chunk + 1} (code {e.code}: {ctx.last_error})") from None


def compute_perplexity(
    model,
    tokens,
    n_ctx: int = 512,
    n_batch: int = 512,
    n_ubatch: int = 512,
    type_k: str = "f16",
    type_v: str = "f16",
    flash_attn: str = "on",
    n_chunks: int = -1,
    n_threads: Optional[int] = None,
    rotation: bool = True,
    base_out=None,
    kl_base: Optional[LogitsFile] = None,
    on_chunk: Optional[Callable[[int, int, "PerplexityResult"], None]] = None,
) -> PerplexityResult:
    """Run the protocol on `tokens` (tokenized with the model's BOS rule). base_out: a path to
    write llama-perplexity's base file to; kl_base: an open base file to score against (its
    tokens and n_ctx are used, as llama-perplexity does)."""
    if kl_base is not None:
        if kl_base.n_vocab != model.hparams.n_vocab:
            raise KvchatError(
                f"the base file's vocabulary has {kl_base.n_vocab} tokens, the model's "
                f"{model.hparams.n_vocab}: it was made with another model"
            )
        tokens, n_ctx = kl_base.tokens, kl_base.n_ctx
        n_chunk_max = kl_base.n_chunk
    else:
        check_length(len(tokens), n_ctx)
        n_chunk_max = len(tokens) // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    ctx = make_context(model, n_ctx, n_batch, n_ubatch, type_k, type_v, flash_attn, n_threads, rotation)
    first = n_ctx // 2
    k = n_scored(n_ctx)
    n_vocab = int(model.hparams.n_vocab)
    tokens = np.asarray(tokens, dtype=np.int64)
    writer = LogitsFileWriter(base_out, n_ctx, n_vocab, n_chunk, tokens) if base_out else None
    res = PerplexityResult(kld=KLDStats() if kl_base is not None else None)
    nll_sum = nll2_sum = 0.0
    t0 = time.perf_counter()
    try:
        for i in range(n_chunk):
            chunk = chunk_input(model, tokens, i, n_ctx)
            rows = np.empty((k, row_words(n_vocab)), dtype=np.uint16) if writer else None
            base = kl_base.chunk_rows(i) if kl_base is not None else None
            for pos, logits in chunk_outputs(ctx, chunk, first, i):
                targets = tokens[i * n_ctx + pos + 1]
                nll = np.empty(pos.shape[0])
                lo, hi = int(pos[0]) - first, int(pos[-1]) - first + 1  # positions are consecutive
                if writer is not None:
                    quantize_log_prob_rows(logits, targets, rows[lo:hi], nll)
                elif base is not None:
                    res.kld.add_rows(logits, np.asarray(base[lo:hi]), targets, pos)
                    nll = res.kld.nll[-1]
                else:
                    nll_rows(logits, targets, nll)
                nll_sum += float(nll.sum())
                nll2_sum += float((nll * nll).sum())
                res.n_scored += nll.shape[0]
            if writer is not None:
                writer.write_rows(rows)
            res.running.append(math.exp(nll_sum / res.n_scored))
            if on_chunk is not None:
                on_chunk(i, n_chunk, res)
        if writer is not None:
            writer.close()
            writer = None
    finally:
        if writer is not None:
            writer.abort()
    res.seconds = time.perf_counter() - t0
    if res.n_scored:
        mean = nll_sum / res.n_scored
        var = nll2_sum / res.n_scored - mean * mean
        res.ppl = math.exp(mean)
        res.stderr = math.sqrt(var / (res.n_scored - 1)) * res.ppl if var > 0 else float("nan")
    return res
