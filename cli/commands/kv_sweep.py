"""`kvchat kv-sweep`: KV cache types compared in one run (runtime/eval/kv_sweep.py does the work).

    kvchat kv-sweep -m MODEL -f TEXT --k f16,q8_0,q4_0 --v f16,q8_0,q4_0 [-c 512,4096]
                    [--chunks N] [--rot auto,off] [--json F] [--csv F] [--plot F.png] [--needle]

Every (K, V) pair and the K-only / V-only controls are scored against f16/f16 on the same
chunks (llama-perplexity's KLD statistics), with their KV size, session size and speed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kvchat.cli.option_params import hf_option
from kvchat.cli.options import MODEL_HELP
from kvchat.runtime.errors import KvchatError


def _list(flag: str, value: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise KvchatError(f"{flag}: give a comma-separated list, e.g. {flag} f16,q8_0,q4_0")
    return items


def _types(flag: str, value: str) -> list[str]:
    from kvchat.kernels.ggml_types import cache_type_by_name

    out = []
    for t in _list(flag, value):
        try:
            out.append(cache_type_by_name(t).name)
        except ValueError as e:
            raise KvchatError(f"{flag}: {e}") from None
    return out


def _ints(flag: str, value: str) -> list[int]:
    try:
        out = [int(x) for x in _list(flag, value)]
    except ValueError:
        raise KvchatError(f"{flag}: '{value}' is not a comma-separated list of integers") from None
    if any(x < 16 for x in out):
        raise KvchatError(f"{flag}: context sizes must be at least 16")
    return out


def _rots(value: str) -> list[bool]:
    out = []
    for r in _list("--rot", value):
        if r not in ("auto", "off", "on"):
            raise KvchatError(f"--rot: '{r}' is not one of auto, off")
        out.append(r != "off")
    return list(dict.fromkeys(out))


def register(app: typer.Typer) -> None:
    @app.command("kv-sweep")
    def kv_sweep(
        model: str = typer.Option(None, "-m", "--model", help=MODEL_HELP),
        hf: Optional[str] = hf_option(),
        file: Path = typer.Option(..., "-f", "--file", help="text to score (llama-perplexity chunks)"),
        k: str = typer.Option("f16,q8_0,q4_0", "--k", help="K cache types, comma-separated"),
        v: str = typer.Option("f16,q8_0,q4_0", "--v", help="V cache types, comma-separated"),
        ctx_sizes: str = typer.Option("512", "-c", "--ctx-size", help="context sizes, e.g. 512,4096"),
        chunks: int = typer.Option(-1, "--chunks", help="chunks per context size (-1: all)"),
        rot: str = typer.Option("auto", "--rot", help="Hadamard rotation of quantized caches: auto,off"),
        flash_attn: str = typer.Option(
            "on", "-fa", "--flash-attn", help="flash attention of the configurations (quantized V needs on)"
        ),
        n_pp: int = typer.Option(512, "--pp", min=0, help="prompt tokens of the speed test (0: skip)"),
        n_tg: int = typer.Option(128, "--tg", min=0, help="generated tokens of the speed test (0: skip)"),
        depth: int = typer.Option(
            -1, "--depth", min=-1, help="cache depth of the tg test (-1: n_ctx - tg - 1, so generation ends at n_ctx)"
        ),
        threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, help="CPU threads"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write rows + provenance as JSON"),
        csv_out: Optional[Path] = typer.Option(None, "--csv", help="write the rows as CSV"),
        plot_out: Optional[Path] = typer.Option(None, "--plot", help="write a PNG (needs matplotlib)"),
        needle: bool = typer.Option(False, "--needle", help="also run the long-context retrieval probe"),
        needle_len: str = typer.Option(
            "", "--needle-len", help="needle haystack lengths in tokens (default: the model's usable lengths)"
        ),
    ):
        """Compare KV cache types against f16/f16 on the same tokens: KLD, size, speed."""
        from rich.console import Console

        from kvchat.cli.commands.perplexity import read_text
        from kvchat.cli.reports.kv_sweep_report import (
            load_average,
            mark_pareto,
            provenance,
            render_table,
            write_csv,
            write_json,
        )
        from kvchat.cli.sources.models import resolve_model
        from kvchat.runtime.eval.kv_sweep import measure_speed, run_sweep, sweep_configs
        from kvchat.runtime.model import Model

        ks, vs, ctxs, rots = _types("--k", k), _types("--v", v), _ints("-c", ctx_sizes), _rots(rot)
        if flash_attn not in ("on", "off"):
            raise KvchatError(f"-fa: '{flash_attn}' is not one of on, off")
        if flash_attn == "off":
            from kvchat.kernels.ggml_types import cache_type_by_name

            bad = [t for t in vs if cache_type_by_name(t).block_size != 1]
            if bad:
                raise KvchatError(
                    f"--v {','.join(bad)}: a quantized V cache needs flash attention "
                    f"(drop -fa off or use float V types)"
                )
        if plot_out is not None:
            from kvchat.cli.reports.kv_sweep_plot import require_matplotlib

            require_matplotlib()
        for p in (json_out, csv_out, plot_out):
            if p is not None and not p.parent.is_dir():
                raise KvchatError(f"cannot write '{p}': folder '{p.parent}' does not exist")
        text = read_text(file)
        model_path = resolve_model(model, hf=hf)
        m = Model.load(model_path)
        tokens = m.vocab.tokenize(text, add_special=True, parse_special=False)
        for n_ctx in ctxs:
            if len(tokens) < n_ctx:
                raise KvchatError(
                    f"'{file}' tokenizes to {len(tokens)} tokens, fewer than one chunk "
                    f"of -c {n_ctx}; give a longer text or a smaller -c"
                )
        configs = sweep_configs(ks, vs, rots)
        err = Console(stderr=True)
        out = Console() if sys.stdout.isatty() else Console(width=220)  # a pipe gets whole lines
        n_chunks = {n: (len(tokens) // n if chunks < 0 else min(chunks, len(tokens) // n)) for n in ctxs}
        steps = sum(n_chunks[n] * (len(configs) + 1) for n in ctxs)
        steps += len(ctxs) * (len(configs) + 1) * (1 if (n_pp or n_tg) else 0)
        cases = []
        if needle:
            from kvchat.runtime.eval.kv_needle import default_lengths, needle_cases

            lengths = _ints("--needle-len", needle_len) if needle_len else default_lengths(m, len(tokens))
            cases = needle_cases(m, tokens, lengths)
            steps += len(cases) * (len(configs) + 1)
        err.print(
            f"kv-sweep: {len(configs)} configurations + f16/f16 reference, "
            f"{', '.join(f'{n_chunks[n]} chunks of {n}' for n in ctxs)}, {len(tokens)} tokens"
        )

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("kv-sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=err,
            transient=True,
            disable=not err.is_terminal,
        )

        def state_size(ctx, chunk):
            from kvchat.cli.session.session import SessionData, encode_session

            blob = ctx.state_seq_get_data(0)
            sess = encode_session(
                SessionData(model={}, cache={}, messages=[], sampling={}, tokens=[int(t) for t in chunk], state=blob)
            )
            return len(blob), len(sess)

        all_rows, pairs = [], []
        t0, c0, load0 = time.perf_counter(), time.process_time(), load_average()
        with progress:
            task = progress.add_task("sweep", total=steps, info="")

            done = [0]

            def step(label):
                progress.update(task, advance=1, info=label)
                done[0] += 1
                if not err.is_terminal:  # a log file still shows how far the run is
                    print(f"kv-sweep: [{done[0]}/{steps}] {label}", file=sys.stderr, flush=True)

            for n_ctx in ctxs:
                ref_row, rows = run_sweep(
                    m,
                    tokens,
                    configs,
                    n_ctx,
                    n_chunks=chunks,
                    n_threads=threads,
                    flash_attn=flash_attn,
                    on_step=step,
                    state_size=state_size,
                )
                dicts = [ref_row.as_dict(m.hparams)] + [r.as_dict(m.hparams) for r in rows]
                if n_pp or n_tg:
                    d = n_ctx - n_tg - 1 if depth < 0 else depth
                    for row, dd in zip([ref_row] + rows, dicts):
                        dd.update(measure_speed(m, row.config, n_pp, n_tg, max(d, 0), threads))
                        step(f"speed {row.config.label} @ {n_ctx}")
                mark_pareto(dicts)
                all_rows += dicts
                pairs += _pairs([ref_row] + rows, n_ctx)
            needle_rows = []
            if cases:
                from kvchat.runtime.eval.kv_needle import run_needle

                results = run_needle(m, [ref_row.config] + configs, cases, threads, flash_attn, step)
                for cfg, res in zip([ref_row.config] + configs, results):
                    needle_rows += [
                        dict(type_k=cfg.type_k, type_v=cfg.type_v, rot="auto" if cfg.rotation else "off", **c)
                        for c in res.cases
                    ]
        run = dict(
            seconds=time.perf_counter() - t0,
            cpu_seconds=time.process_time() - c0,
            load_average=dict(start=load0, end=load_average()),
        )
        err.print(_run_line(run))
        render_table(all_rows, out)
        _print_pairs(pairs, out)
        if needle_rows:
            from kvchat.runtime.eval.kv_needle import render_needle

            render_needle(needle_rows, out)
        flags = dict(
            k=ks,
            v=vs,
            ctx_sizes=ctxs,
            chunks=chunks,
            rot=rot,
            flash_attn=flash_attn,
            pp=n_pp,
            tg=n_tg,
            depth=depth,
            threads=threads,
        )
        if json_out or csv_out:
            prov = provenance(model_path, file, flags, threads, run)
            if json_out:
                write_json(json_out, prov, all_rows, pairs, needle_rows)
                err.print(f"wrote {json_out}")
            if csv_out:
                write_csv(csv_out, all_rows)
                err.print(f"wrote {csv_out}")
        if plot_out:
            from kvchat.cli.reports.kv_sweep_plot import plot_sweep

            plot_sweep(plot_out, all_rows, f"{Path(model_path).name} on {file.name}: KV cache types vs f16/f16")
            err.print(f"wrote {plot_out}")


def _run_line(run: dict) -> str:
    """'kv-sweep: 212 s, 390 s of CPU, load average 0.4 -> 2.1': the CPU time says how long
    the work is, the load how much a busy machine stretched the wall time."""
    la = run["load_average"]
    load = (
        f", load average {la['start'][0]:.1f} -> {la['end'][0]:.1f}"
        if la["start"] is not None and la["end"] is not None
        else ""
    )
    return f"kv-sweep: {run['seconds']:.0f} s, {run['cpu_seconds']:.0f} s of CPU{load}"


def _pairs(rows, n_ctx) -> list[dict]:
    """Paired differences of Mean KLD between every two configurations of one n_ctx."""
    from kvchat.runtime.eval.kv_sweep import paired_difference

    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            d = paired_difference(a.stats, b.stats)
            out.append(dict(a=a.config.label, b=b.config.label, n_ctx=n_ctx, **d))
    return out


def _print_pairs(pairs, console) -> None:
    """Pairs that share K or V type, or differ only in rotation: the comparisons people ask for."""

    def parts(label):
        kv, _, rot = label.partition(" ")
        k, v = kv.split("/")
        return k, v, rot

    shown = []
    for p in pairs:
        ka, va, ra = parts(p["a"])
        kb, vb, rb = parts(p["b"])
        if (ka, va) == (kb, vb) or (ra == rb and (ka == kb or va == vb)):
            shown.append(p)
    if not shown:
        return
    console.print("\nPaired Mean KLD differences (same tokens), 95 % interval:")
    for p in shown:
        verdict = "differ" if p["differ"] else "not distinguishable"
        console.print(
            f"  {p['a']:>20} − {p['b']:<20} @ {p['n_ctx']}: {p['mean_diff']:+.5f} "
            f"[{p['ci95_lo']:+.5f}, {p['ci95_hi']:+.5f}]  {verdict}"
        )
