"""`kvchat bench-batched`: llama-batched-bench's table — prompt and generation speed with B
sequences decoded together.

For every (PP, TG, B) of the grid: clear the memory; decode the prompt (PP random tokens) once
for sequence 0 and `seq_cp` it to the others (shared, the default) or PP tokens for each of the
B sequences (without `-pps`); then TG steps, each one `decode()` carrying one token of
every sequence. N_KV = cells the test needs (PP + B*TG shared, B*(PP+TG) separate); a test that
does not fit the context is skipped, as llama.cpp does. S_TG = B*TG / T_TG is the aggregate
generation throughput the batch buys.

Flag names follow llama-batched-bench (`-pps` = is_pp_shared, `-kvu` = one cell pool).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import typer

from kvchat.cli.option_params import with_settings
from kvchat.cli.options import CACHE_FLAGS, ChatSettings
from kvchat.runtime.errors import KvchatError


def parse_list(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; a one-line KvchatError for anything else."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise KvchatError(f"{what}: expected non-negative integers, got {text!r}")
    return vals


def n_kv_required(pp: int, tg: int, pl: int, shared: bool) -> int:
    return pp + pl * tg if shared else pl * (pp + tg)


def _decode(ctx, batch) -> None:
    rc = ctx.decode(batch)
    if rc != 0:
        raise KvchatError(f"decode failed (code {rc}: {ctx.last_error}); try a larger -c")


def run_case(ctx, pp: int, tg: int, pl: int, shared: bool, rng) -> dict:
    """One (PP, TG, B) test; returns the row of the table (times in seconds)."""
    from kvchat.runtime.batch import Batch

    n_vocab = ctx.n_vocab
    n_batch = ctx.n_batch
    ctx.memory.clear(True)
    n_prompt_seqs = 1 if shared else pl
    toks, pos, seqs, outs = [], [], [], []
    for j in range(n_prompt_seqs):
        for i in range(pp):
            toks.append(int(rng.integers(0, n_vocab)))
            pos.append(i)
            seqs.append([j])
            outs.append(i == pp - 1)
    t0 = time.perf_counter()
    for k in range(0, len(toks), n_batch):
        _decode(
            ctx,
            Batch(
                toks[k : k + n_batch],
                pos=pos[k : k + n_batch],
                seq_ids=seqs[k : k + n_batch],
                logits=outs[k : k + n_batch],
            ),
        )
    if shared:
        for j in range(1, pl):
            ctx.memory.seq_cp(0, j, -1, -1)
    t_pp = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(tg):
        step = [int(t) for t in rng.integers(0, n_vocab, pl)]
        _decode(ctx, Batch(step, pos=[pp + i] * pl, seq_ids=[[j] for j in range(pl)], logits=[True] * pl))
    t_tg = time.perf_counter() - t1
    t = t_pp + t_tg
    n_pp = pp if shared else pl * pp
    return {
        "n_kv_max": ctx.n_ctx,
        "n_batch": n_batch,
        "n_ubatch": ctx.n_ubatch,
        "flash_attn": int(ctx.cparams.flash_attn),
        "is_pp_shared": int(shared),
        "n_threads": ctx.n_threads,
        "pp": pp,
        "tg": tg,
        "pl": pl,
        "n_kv": n_kv_required(pp, tg, pl, shared),
        "t_pp": t_pp,
        "speed_pp": n_pp / t_pp if t_pp > 0 else 0.0,
        "t_tg": t_tg,
        "speed_tg": pl * tg / t_tg if t_tg > 0 else 0.0,
        "t": t,
        "speed": (n_pp + pl * tg) / t if t > 0 else 0.0,
    }


HEADER = (
    "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
    "      T s |    S t/s |\n"
    "|-------|--------|------|--------|----------|----------|----------|----------|"
    "----------|----------|"
)


def table_row(r: dict) -> str:
    return (
        f"|{r['pp']:6d} | {r['tg']:6d} | {r['pl']:4d} | {r['n_kv']:6d} | {r['t_pp']:8.3f} | "
        f"{r['speed_pp']:8.2f} | {r['t_tg']:8.3f} | {r['speed_tg']:8.2f} | {r['t']:8.3f} | "
        f"{r['speed']:8.2f} |"
    )


# the shared context / cache flags (cli/options.py); -c 0 here means "what the largest test needs"
BATCHED_DEFAULTS = {"ctx_size": {"help": "context size (0: what the largest test needs)", "default": 0}}


def register(app: typer.Typer) -> None:
    @app.command("bench-batched")
    @with_settings(names=CACHE_FLAGS, overrides=BATCHED_DEFAULTS)
    def bench_batched(
        npp: str = typer.Option("128", "-npp", help="prompt lengths, comma-separated"),
        ntg: str = typer.Option("64", "-ntg", help="generated tokens per sequence, comma-separated"),
        npl: str = typer.Option("1,2,4,8", "-npl", help="parallel sequence counts, comma-separated"),
        pps: bool = typer.Option(
            False,
            "-pps",
            help="the prompt is shared by all sequences (decoded once, seq_cp'd); default: one prompt per sequence",
        ),
        kv_unified: bool = typer.Option(
            True,
            "-kvu/-no-kvu",
            "--kv-unified/--no-kv-unified",
            help="one cell pool for all sequences (else a stream each)",
        ),
        output_format: str = typer.Option("md", "--output-format", help="md or jsonl"),
        settings: ChatSettings = None,
    ):
        """Speeds with B sequences per decode, llama-batched-bench style (PP, TG, B, N_KV, ...)."""
        model, ctx_size, threads = settings.model, settings.ctx_size, settings.threads
        batch_size, ubatch_size = settings.batch_size, settings.ubatch_size
        cache_type_k, cache_type_v, flash_attn = (settings.cache_type_k, settings.cache_type_v, settings.flash_attn)
        from kvchat.cli.sources.models import resolve_model
        from kvchat.runtime.context import Context
        from kvchat.runtime.cparams import ContextParams, CParamsError
        from kvchat.runtime.model import Model

        if output_format not in ("md", "jsonl"):
            raise KvchatError(f"--output-format must be md or jsonl, got {output_format!r}")
        pps_l, tgs, pls = parse_list(npp, "-npp"), parse_list(ntg, "-ntg"), parse_list(npl, "-npl")
        if min(pls) < 1:
            raise KvchatError("-npl: every sequence count must be at least 1")
        need = max(n_kv_required(p, g, b, pps) for p in pps_l for g in tgs for b in pls)
        n_seq_max = max(pls)
        n_ctx = ctx_size or (
            need if kv_unified else max(n_kv_required(p, g, 1, False) for p in pps_l for g in tgs) * n_seq_max
        )
        m = Model.load(resolve_model(model))
        try:
            ctx = Context(
                m,
                ContextParams(
                    n_ctx=n_ctx,
                    n_batch=batch_size,
                    n_ubatch=ubatch_size,
                    type_k=cache_type_k,
                    type_v=cache_type_v,
                    flash_attn=flash_attn,
                    n_threads=threads,
                    n_seq_max=n_seq_max,
                    kv_unified=kv_unified,
                ),
            )
        except CParamsError as e:
            raise KvchatError(str(e)) from None
        import numba

        if ctx.n_threads is None:
            ctx.n_threads = numba.get_num_threads()
        rng = np.random.default_rng(1234)
        print(
            f"main: n_kv_max = {ctx.n_ctx}, n_batch = {ctx.n_batch}, n_ubatch = {ctx.n_ubatch}, "
            f"flash_attn = {int(ctx.cparams.flash_attn)}, is_pp_shared = {int(pps)}, "
            f"kv_unified = {int(kv_unified)}, n_threads = {ctx.n_threads}",
            file=sys.stderr,
        )
        # warm-up (numba compilation, first touch of the weights): not reported
        for pl in pls:  # each batch width once: kernel paths differ between 1 and B tokens
            if n_kv_required(min(pps_l[0], 32), 2, pl, pps) <= ctx.n_ctx_seq * (1 if kv_unified else pl):
                run_case(ctx, min(pps_l[0], 32), 2, pl, pps, rng)
        if output_format == "md":
            print(HEADER)
        for pp in pps_l:
            for tg in tgs:
                for pl in pls:
                    if pp + tg == 0:
                        continue
                    req = n_kv_required(pp, tg, pl, pps)
                    per_stream = req if kv_unified else n_kv_required(pp, tg, 1, False)
                    if per_stream > ctx.n_ctx_seq:
                        print(
                            f"skipping PP={pp} TG={tg} B={pl}: needs {req} cells, the context has {ctx.n_ctx}",
                            file=sys.stderr,
                        )
                        continue
                    r = run_case(ctx, pp, tg, pl, pps, rng)
                    print(table_row(r) if output_format == "md" else json.dumps(r), flush=True)
