"""`kvchat bench`: prompt-processing and generation speed in the manner of llama-bench.

Tests: `pp N` decodes N random tokens as batches of n_batch (only the last token's logits),
`tg N` generates N tokens one at a time; with `-d DEPTH` the cache first holds DEPTH tokens
(filled before the clock starts). Every test runs once untimed (kernel compilation, first-touch
of the weights) and then `-r` timed repetitions on a cleared memory; t/s is reported as mean ±
standard deviation over the repetitions, in llama-bench's markdown table or as --json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import typer

from kvchat.cli.option_params import with_settings
from kvchat.cli.options import ChatSettings
from kvchat.runtime.errors import KvchatError


def _fill(ctx, tokens, pos0=0):
    """Decode tokens into sequence 0 in n_batch pieces (no logits kept: only the cost counts)."""
    from kvchat.runtime.generate import DecodeError, decode_tokens

    try:
        decode_tokens(ctx, tokens, pos0, 0, logits="none")
    except DecodeError as e:
        raise KvchatError(f"{e} ({ctx.last_error}); try a larger context") from None


def run_test(ctx, kind: str, n: int, depth: int, rng) -> float:
    """One timed repetition; returns tokens per second.

    pp: n random tokens decoded as a prompt. tg: n tokens one at a time through generate(),
    the chat's own loop, drawing random tokens instead of sampling (llama-bench's tg)."""
    from kvchat.runtime.generate import generate

    n_vocab = ctx.model.hparams.n_vocab
    ctx.memory.clear(True)
    if depth:
        _fill(ctx, list(rng.integers(0, n_vocab, depth)), 0)
    toks = [int(t) for t in rng.integers(0, n_vocab, n)]
    t0 = time.perf_counter()
    if kind == "pp":
        _fill(ctx, toks, depth)
    else:
        # the prompt token, then n - 1 decoded steps (the n-th drawn token is not decoded)
        source = iter(toks[1:] + toks[:1])
        steps = generate(ctx, lambda logits: next(source), prompt=toks[:1], pos0=depth, max_tokens=n)
        for _ in steps:
            pass
        if steps.n_decoded != n - 1:
            raise KvchatError(f"generation stopped early ({steps.stop}) after {steps.n_decoded} tokens")
    return n / (time.perf_counter() - t0)


def model_desc(model) -> str:
    label = model.gguf.get("general.size_label") or f"{model.n_params / 1e6:.0f}M"
    return f"{model.hparams.arch} {label} {model.ftype_name}"


BENCH_FLAGS = (
    "model",
    "hf_repo",
    "threads",
    "exact",
    "batch_size",
    "ubatch_size",
    "cache_type_k",
    "cache_type_v",
    "flash_attn",
)
SPEC_FLAGS = ("model_draft", "draft_max", "draft_min", "draft_p_min")


def register(app: typer.Typer) -> None:
    @app.command("bench")
    @with_settings(names=BENCH_FLAGS + SPEC_FLAGS)
    def bench(
        n_prompt: int = typer.Option(512, "-p", "--n-prompt", min=0, help="prompt tokens (0: skip pp)"),
        n_gen: int = typer.Option(128, "-n", "--n-gen", min=0, help="generated tokens (0: skip tg)"),
        reps: int = typer.Option(3, "-r", "--repetitions", min=1, help="timed repetitions per test"),
        depth: int = typer.Option(0, "-d", "--n-depth", min=0, help="tokens already in the cache"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
        spec: str = typer.Option(
            None,
            "--spec",
            help="speculative decoding's speed-up instead: draft (with -md), ngram or self:TYPE, "
            "greedy -n tokens plain and speculative, alternately",
            rich_help_panel="Speculative decoding",
        ),
        prompt_file: Path = typer.Option(
            None,
            "--prompt-file",
            help="with --spec: the user message (default: a coding request)",
            rich_help_panel="Speculative decoding",
        ),
        raw_prompt: bool = typer.Option(
            False,
            "--raw-prompt",
            help="with --spec: the prompt file's text as it is, not a user message in the chat template (a base model)",
            rich_help_panel="Speculative decoding",
        ),
        ctx_size: int = typer.Option(4096, "-c", "--ctx-size", min=64, help="with --spec: context size"),
        settings: ChatSettings = None,
    ):
        """Measure pp (prompt) and tg (generation) speed, llama-bench style."""
        from kvchat.cli.sources.models import resolve_model
        from kvchat.runtime.context import Context
        from kvchat.runtime.model import Model

        m = Model.load(resolve_model(settings.model))
        if spec is not None:
            from kvchat.cli.commands.bench_spec import bench_spec
            from kvchat.cli.option_checks import spec_type_value

            try:
                kind = spec_type_value(spec)
            except ValueError as e:
                raise KvchatError(f"--spec: {e}") from None
            draft = resolve_model(settings.model_draft) if settings.model_draft else None
            ctx = Context(m, settings.context_params(n_ctx=ctx_size))
            bench_spec(ctx, settings, kind, prompt_file, n_gen, reps, as_json, draft, raw_prompt)
            return
        n_ctx = depth + max(n_prompt, n_gen) + 1
        ctx = Context(m, settings.context_params(n_ctx=n_ctx))
        cache_type_k, cache_type_v, threads = settings.cache_type_k, settings.cache_type_v, settings.threads
        n_batch = ctx.cparams.n_batch
        import numba

        n_threads = threads or numba.get_num_threads()
        rows = []
        rng = np.random.default_rng(1234)
        for kind, n in (("pp", n_prompt), ("tg", n_gen)):
            if n <= 0:
                continue
            print(f"bench: {kind}{n} warm-up ...", file=sys.stderr)
            t0 = time.perf_counter()
            run_test(ctx, kind, n, depth, rng)  # warm-up, not counted
            warm = time.perf_counter() - t0
            speeds = [run_test(ctx, kind, n, depth, rng) for _ in range(reps)]
            name = f"{kind}{n}" + (f" @ d{depth}" if depth else "")
            rows.append(
                dict(
                    model=model_desc(m),
                    model_filename=str(m.path),
                    size_bytes=m.size_bytes,
                    n_params=m.n_params,
                    n_threads=n_threads,
                    type_k=cache_type_k,
                    type_v=cache_type_v,
                    flash_attn=bool(ctx.cparams.flash_attn),
                    n_batch=n_batch,
                    n_ubatch=ctx.cparams.n_ubatch,
                    test=name,
                    n_prompt=n if kind == "pp" else 0,
                    n_gen=n if kind == "tg" else 0,
                    n_depth=depth,
                    avg_ts=statistics.mean(speeds),
                    stddev_ts=statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                    samples_ts=speeds,
                    warmup_s=warm,
                )
            )
        if as_json:
            print(json.dumps(rows, indent=2))
            return
        print("| model | size | params | backend | threads | type_k | type_v | fa | test | t/s |")
        print("| ----- | ---: | -----: | ------- | ------: | -----: | -----: | -: | ---: | --: |")
        for r in rows:
            print(
                f"| {r['model']} | {r['size_bytes'] / 2**20:.2f} MiB | {r['n_params'] / 1e6:.2f} M | "
                f"CPU (numba) | {r['n_threads']} | {r['type_k']} | {r['type_v']} | "
                f"{int(r['flash_attn'])} | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |"
            )
