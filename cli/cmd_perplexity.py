"""`kvchat perplexity`: llama-perplexity's protocol and output on our engine.

Protocol (tools/perplexity/perplexity.cpp): tokenize the whole file (BOS if the model adds
one), cut n_tokens // n_ctx chunks of n_ctx tokens; for each chunk clear the memory, put BOS
in place of its first token when the model adds BOS, decode it in n_batch batches with all
logits, and score the second half: the logits at position i (n_ctx/2 <= i < n_ctx - 1) give
-log p(token i+1). PPL = exp(mean NLL). Output: the running value after each chunk
(`[1]16.5546,[2]17.8938,...`), then `Final estimate: PPL = X +/- Y` where Y is the standard
error of the mean NLL times PPL, as llama.cpp prints it.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import typer

from runtime.errors import KvchatError


@dataclass
class PerplexityResult:
    running: list[float] = field(default_factory=list)  # PPL after each chunk
    ppl: float = float("nan")
    stderr: float = float("nan")
    n_scored: int = 0
    seconds: float = 0.0


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, in float64. logits [n, n_vocab] f32."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return lse - x[np.arange(x.shape[0]), targets]


def compute_perplexity(model, tokens: list[int], n_ctx: int = 512, n_batch: int = 512,
                       n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16",
                       flash_attn: str = "on", n_chunks: int = -1, n_threads: Optional[int] = None,
                       on_chunk: Optional[Callable[[int, int, float], None]] = None) -> PerplexityResult:
    """Run the protocol on `tokens` (already tokenized with the model's BOS rule)."""
    from runtime.batch import Batch
    from runtime.context import Context
    from runtime.cparams import ContextParams

    if len(tokens) < 2 * n_ctx:
        raise KvchatError(f"the text tokenizes to only {len(tokens)} tokens; perplexity with a "
                          f"context of {n_ctx} needs at least {2 * n_ctx} (use a smaller -c)")
    n_batch = min(n_batch, n_ctx)
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch),
                                       type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                                       n_threads=n_threads))
    n_chunk_max = len(tokens) // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    add_bos = bool(model.vocab.add_bos)
    first = n_ctx // 2
    res = PerplexityResult()
    nll_sum = nll2_sum = 0.0
    t0 = time.perf_counter()
    for i in range(n_chunk):
        start = i * n_ctx
        chunk = list(tokens[start:start + n_ctx])
        if add_bos:
            chunk[0] = model.vocab.bos
        ctx.memory.clear(True)
        rows = []
        for j in range(0, n_ctx, n_batch):
            part = chunk[j:j + n_batch]
            rc = ctx.decode(Batch.one_seq(part, j, all_logits=True))
            if rc != 0:
                raise KvchatError(f"decode failed on chunk {i + 1} (code {rc}: {ctx.last_error})")
            rows.append(ctx.get_logits().copy())
        logits = np.concatenate(rows, axis=0)  # [n_ctx, n_vocab] f32
        targets = np.asarray(tokens[start + first + 1:start + n_ctx], dtype=np.int64)
        nll = _nll_rows(logits[first:n_ctx - 1], targets)
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        res.n_scored += nll.shape[0]
        res.running.append(math.exp(nll_sum / res.n_scored))
        if on_chunk is not None:
            on_chunk(i, n_chunk, res.running[-1])
    res.seconds = time.perf_counter() - t0
    if res.n_scored:
        mean = nll_sum / res.n_scored
        var = nll2_sum / res.n_scored - mean * mean
        res.ppl = math.exp(mean)
        res.stderr = math.sqrt(var / (res.n_scored - 1)) * res.ppl if var > 0 else float("nan")
    return res


def register(app: typer.Typer) -> None:
    @app.command("perplexity")
    def perplexity(
        model: str = typer.Option(None, "-m", "--model", help="smollm2, gemma3 or a .gguf path"),
        file: Path = typer.Option(..., "-f", "--file", help="text file to evaluate"),
        ctx_size: int = typer.Option(512, "-c", "--ctx-size", min=16, help="tokens per chunk"),
        batch_size: int = typer.Option(512, "-b", "--batch-size", min=1, help="logical batch size"),
        ubatch_size: int = typer.Option(512, "-ub", "--ubatch-size", min=1, help="physical batch size"),
        cache_type_k: str = typer.Option("f16", "-ctk", "--cache-type-k", help="K cache type"),
        cache_type_v: str = typer.Option("f16", "-ctv", "--cache-type-v", help="V cache type"),
        flash_attn: str = typer.Option("on", "-fa", "--flash-attn", help="on, off or auto"),
        chunks: int = typer.Option(-1, "--chunks", help="max chunks to evaluate (-1: all)"),
        threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, help="CPU threads"),
    ):
        """Perplexity of a text, as llama-perplexity computes it (second half of each chunk)."""
        from cli.models import resolve_model
        from runtime.model import Model

        if not file.is_file():
            raise KvchatError(f"text file '{file}' not found; give an existing file with -f")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise KvchatError(f"'{file}' is not UTF-8 text ({e.reason} at byte {e.start})")
        m = Model.load(resolve_model(model))
        tokens = m.vocab.tokenize(text, add_special=True, parse_special=False)
        print(f"perplexity: {len(tokens)} tokens, {len(tokens) // ctx_size if ctx_size else 0} chunks "
              f"of {ctx_size}, batch {min(batch_size, ctx_size)}, cache {cache_type_k}/{cache_type_v}, "
              f"flash attention {flash_attn}", file=sys.stderr)

        progress = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            progress = Progress(TextColumn("chunks"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("PPL {task.fields[ppl]}"), TimeRemainingColumn(),
                                console=Console(stderr=True), transient=True)
            progress.start()
            task = progress.add_task("ppl", total=None, ppl="-")

        def on_chunk(i, n, ppl):
            if progress is not None:
                progress.update(task, total=n, completed=i + 1, ppl=f"{ppl:.4f}")
            else:
                sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
                sys.stdout.flush()

        try:
            res = compute_perplexity(m, tokens, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size,
                                     type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn,
                                     n_chunks=chunks, n_threads=threads, on_chunk=on_chunk)
        finally:
            if progress is not None:
                progress.stop()
        if progress is not None:  # the running values once, as llama-perplexity prints them
            sys.stdout.write("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res.running)))
        sys.stdout.write("\n")
        print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.stderr:.5f}")
        print(f"perplexity: {res.n_scored} tokens scored in {res.seconds:.1f} s "
              f"({len(res.running) * ctx_size / max(res.seconds, 1e-9):.1f} tokens/s)", file=sys.stderr)
