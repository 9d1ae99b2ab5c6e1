"""`kvchat perplexity`: llama-perplexity's command line and output on runtime/eval/perplexity.py.

Three modes, as llama-perplexity has them:
  -f TEXT                                   running PPL per chunk, then `Final estimate: PPL = X +/- Y`
  -f TEXT --kl-divergence-base FILE         the same, and writes FILE (llama.cpp's logits format)
  --kl-divergence-base FILE --kl-divergence scores this configuration against FILE (its tokens
                                            and n_ctx; no -f needed): per chunk PPL, ln ratio,
                                            KLD, Δp RMS, Same top p; then the closing statistics
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from kvchat.cli.option_checks import at_least
from kvchat.cli.option_params import with_settings
from kvchat.cli.options import CACHE_FLAGS, ChatSettings
from kvchat.runtime.errors import KvchatError


def read_text(file: Path) -> str:
    if not file.is_file():
        raise KvchatError(f"text file '{file}' not found; give an existing file with -f")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise KvchatError(f"'{file}' is not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_cache_types(type_k: str, type_v: str, flash_attn: str) -> None:
    """One line for an unknown type or a quantized V without flash attention."""
    from kvchat.kernels.ggml_types import cache_type_by_name

    for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
        try:
            cache_type_by_name(t)
        except ValueError as e:
            raise KvchatError(f"{flag}: {e}") from None
    info = cache_type_by_name(type_v)
    if flash_attn == "off" and info.block_size != 1:
        raise KvchatError(f"-ctv {type_v}: a quantized V cache needs flash attention (use -fa on or a float V type)")


def _progress(label: str):
    """A rich progress bar on stderr when it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    progress.start()
    return progress, progress.add_task(label, total=None, info="")


# the shared context / cache flags (cli/options.py) with llama-perplexity's defaults
PERPLEXITY_DEFAULTS = {
    "ctx_size": {"default": 512, "help": "tokens per chunk", "check": at_least(16)},
    "batch_size": {"default": 512, "help": "logical batch size"},
    "ubatch_size": {"default": 512, "help": "physical batch size"},
    "flash_attn": {"default": "on"},
}


def register(app: typer.Typer) -> None:
    @app.command("perplexity")
    @with_settings(names=CACHE_FLAGS, overrides=PERPLEXITY_DEFAULTS)
    def perplexity(
        file: Optional[Path] = typer.Option(None, "-f", "--file", help="text file to evaluate"),
        chunks: int = typer.Option(-1, "--chunks", help="max chunks to evaluate (-1: all)"),
        kl_base: Optional[Path] = typer.Option(
            None,
            "--kl-divergence-base",
            help="logits file: written from -f TEXT, or read with "
            "--kl-divergence (llama-perplexity's format; files from either tool work in both)",
        ),
        kl_divergence: bool = typer.Option(
            False, "--kl-divergence", help="score against --kl-divergence-base FILE: KLD, Δp, same top"
        ),
        settings: ChatSettings = None,
    ):
        """Perplexity of a text, as llama-perplexity computes it (second half of each chunk)."""
        model, ctx_size, threads = settings.model, settings.ctx_size, settings.threads
        batch_size, ubatch_size = settings.batch_size, settings.ubatch_size
        cache_type_k, cache_type_v, flash_attn = (settings.cache_type_k, settings.cache_type_v, settings.flash_attn)
        from kvchat.cli.sources.models import resolve_model
        from kvchat.runtime.eval.kld import KLDStats, LogitsFile
        from kvchat.runtime.eval.perplexity import compute_perplexity
        from kvchat.runtime.model import Model

        check_cache_types(cache_type_k, cache_type_v, flash_attn)
        rotation = not os.environ.get("LLAMA_ATTN_ROT_DISABLE")
        base = None
        if kl_divergence:
            if kl_base is None:
                raise KvchatError("--kl-divergence needs --kl-divergence-base FILE (the base logits to compare with)")
            base = LogitsFile(kl_base)
            tokens = None
        else:
            if file is None:
                raise KvchatError("give the text to evaluate with -f FILE")
            text = read_text(file)
        m = Model.load(resolve_model(model))
        if base is None:
            tokens = m.vocab.tokenize(text, add_special=True, parse_special=False)
            print(
                f"perplexity: {len(tokens)} tokens, {len(tokens) // ctx_size} chunks of {ctx_size}, "
                f"batch {min(batch_size, ctx_size)}, cache {cache_type_k}/{cache_type_v}, flash "
                f"attention {flash_attn}" + (f", writing {kl_base}" if kl_base else ""),
                file=sys.stderr,
            )
        else:
            print(
                f"kl-divergence: {base.n_chunk} chunks of {base.n_ctx} from {kl_base}, cache "
                f"{cache_type_k}/{cache_type_v}, flash attention {flash_attn}",
                file=sys.stderr,
            )

        progress, task = _progress("chunks")
        printed_header = []

        def on_chunk(i, n, res):
            if progress is not None:
                progress.update(task, total=n, completed=i + 1, info=f"PPL {res.running[-1]:.4f}")
            if res.kld is not None:
                if not printed_header:
                    print("\n" + KLDStats.HEADER_LINE)
                    printed_header.append(1)
                print(res.kld.chunk_line(i), flush=True)
            elif progress is None:
                sys.stdout.write(f"[{i + 1}]{res.running[-1]:.4f},")
                sys.stdout.flush()

        try:
            res = compute_perplexity(
                m,
                tokens,
                n_ctx=ctx_size,
                n_batch=batch_size,
                n_ubatch=ubatch_size,
                type_k=cache_type_k,
                type_v=cache_type_v,
                flash_attn=flash_attn,
                n_chunks=chunks,
                n_threads=threads,
                rotation=rotation,
                base_out=None if kl_divergence else kl_base,
                kl_base=base,
                on_chunk=on_chunk,
            )
        finally:
            if progress is not None:
                progress.stop()
        if res.kld is not None:
            print()
            for line in res.kld.report_lines():
                print(line)
        else:
            if progress is not None:  # the running values once, as llama-perplexity prints them
                sys.stdout.write("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res.running)))
            sys.stdout.write("\n")
            print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.stderr:.5f}")
        n_ctx = base.n_ctx if base is not None else ctx_size
        print(
            f"perplexity: {res.n_scored} tokens scored in {res.seconds:.1f} s "
            f"({len(res.running) * n_ctx / max(res.seconds, 1e-9):.1f} tokens/s)",
            file=sys.stderr,
        )
