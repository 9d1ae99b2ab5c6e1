"""kvchat against llama.cpp on the same model, interleaved, as ratios.

    python benchmarks/vs_llamacpp.py --llama-bench PATH/llama-bench [-m smollm2 -m gemma3 | -m FILE.gguf]
        [--rounds 3] [--reps 2] [--threads 2] [--tests pp512,tg128,tg128@d4096] [--caches f16,q8_0]
        [--variant NAME=VAR=VALUE,VAR=VALUE ...] [--busy N] [--page-in]

For every model, test and cache type, each round runs ``kvchat bench`` and then ``llama-bench``
with the same settings (one process each, alternating, so that both see the same machine load)
and the table reports the median t/s of the rounds and the ratio of the medians. The machine is
shared: only the ratio of runs made side by side means anything; absolute t/s do not.

``--variant`` runs kvchat once per variant in every round, with those environment variables
(e.g. ``--variant before=OMP_WAIT_POLICY=passive,KVCHAT_MATMUL_PAR_MIN_MACS=4000000 --variant
after=``: an empty list is the defaults), each against the same round's llama-bench. ``--busy N``
keeps N busy-loop processes running for the whole run (a competing load: one core taken), and
stops them at the end. ``--page-in`` reads each tool's own model files into the page cache
before each of its runs (kvchat: its weight pack; llama.cpp: the GGUF) and prints how much of
each file was resident then (benchmarks/page_in.py): for a model whose GGUF and pack do not both
fit in the page cache.

Tests: ``ppN`` (a prompt of N tokens), ``tgN`` (N generated tokens), ``tgN@dD`` (N generated
tokens after D tokens in the cache). Flash attention is on for both (the q8_0 V cache needs it).
How to build llama-bench: docs/performance.md, "Side by side with llama.cpp".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from page_in import kvchat_packs, page_in, resident  # noqa: E402
from tree_env import ENTRY, check_tree, is_tree, tree_env  # noqa: E402

MODELS = {
    "smollm2": Path.home() / ".cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": Path.home() / ".cache/kvchat/models/gemma-3-270m-q4_k_m.gguf",
}


def parse_test(name: str) -> tuple[int, int, int]:
    """ "pp512" -> (512, 0, 0); "tg128" -> (0, 128, 0); "tg128@d4096" -> (0, 128, 4096)."""
    m = re.fullmatch(r"(pp|tg)(\d+)(?:@d(\d+))?", name)
    if not m:
        raise SystemExit(f"vs_llamacpp: test '{name}' is not ppN, tgN or tgN@dD")
    n = int(m.group(2))
    depth = int(m.group(3) or 0)
    return (n, 0, depth) if m.group(1) == "pp" else (0, n, depth)


def _json_tail(text: str):
    """The JSON array a tool printed (kvchat may print a spinner line before it)."""
    i = text.find("[")
    if i < 0:
        raise ValueError(text[-500:])
    return json.loads(text[i:])


def parse_variant(text: str) -> tuple[str, dict]:
    """ "before=A=1,B=2" -> ("before", {"A": "1", "B": "2"}); "after=" -> ("after", {})."""
    name, _, rest = text.partition("=")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise SystemExit(f"vs_llamacpp: variant '{text}': '{item}' is not VAR=VALUE")
        env[var] = value
    if not name:
        raise SystemExit(f"vs_llamacpp: variant '{text}' has no name (NAME=VAR=VALUE,...)")
    return name, env


def variant_env(env: dict | None) -> tuple[dict, str]:
    """(the child's environment, its tree). PYTHONPATH=TREE names the kvchat tree the variant runs
    (a tree's root no longer provides `kvchat`: tree_env maps kvchat.* onto it); without one, this
    script's tree. python -c puts its working directory first on sys.path, so the child runs from
    its tree's root (which holds no `kvchat`)."""
    env = dict(env or {})
    first = env.get("PYTHONPATH", "").split(os.pathsep)[0]
    tree = first if first and is_tree(first) else str(ROOT)
    if first and is_tree(first):
        env["PYTHONPATH"] = os.pathsep.join(env["PYTHONPATH"].split(os.pathsep)[1:])
    return tree_env(tree, {**os.environ, **env}), tree


def start_busy(n: int) -> list[subprocess.Popen]:
    """n processes that each keep one core busy until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def paged_in(what: str, files: list[Path], watch: list[Path]) -> None:
    """files read into the page cache; prints the time and the resident share of every watched file."""
    n, secs = page_in(files)
    shares = ", ".join(f"{p.name} {100 * resident(p):.0f}%" for p in watch)
    print(f"    page-in for {what}: {n / 1e9:.2f} GB in {secs:.1f} s; resident: {shares}", file=sys.stderr, flush=True)


def run_kvchat(
    model: Path, test: tuple[int, int, int], cache: str, reps: int, threads: int, env: dict | None = None
) -> float:
    p, n, d = test
    cmd = [
        sys.executable,
        "-c",
        ENTRY,
        "bench",
        "-m",
        str(model),
        "-p",
        str(p),
        "-n",
        str(n),
        "-d",
        str(d),
        "-r",
        str(reps),
        "-t",
        str(threads),
        "-ctk",
        cache,
        "-ctv",
        cache,
        "-fa",
        "on",
        "--json",
    ]
    env, tree = variant_env(env)
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=True, env=env)
    rows = _json_tail(out.stdout)
    return float(rows[-1]["avg_ts"])


def run_llama(binary: Path, model: Path, test: tuple[int, int, int], cache: str, reps: int, threads: int) -> float:
    p, n, d = test
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-p",
        str(p),
        "-n",
        str(n),
        "-r",
        str(reps),
        "-t",
        str(threads),
        "-ctk",
        cache,
        "-ctv",
        cache,
        "-fa",
        "on",
        "-o",
        "json",
    ]
    if d:
        cmd += ["-d", str(d)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = _json_tail(out.stdout)
    return float(rows[-1]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True, type=Path)
    ap.add_argument("-m", "--model", action="append", help="smollm2, gemma3 or a .gguf path (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="repetitions inside each tool's run (-r)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tests", default="pp512,tg128,tg128@d4096")
    ap.add_argument("--caches", default="f16,q8_0")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=VAR=VALUE,... : a kvchat run with these environment variables (repeatable)",
    )
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes running meanwhile")
    ap.add_argument("--page-in", action="store_true", help="read each tool's files into the page cache before its run")
    a = ap.parse_args()
    if not a.llama_bench.is_file():
        raise SystemExit(f"vs_llamacpp: no llama-bench at {a.llama_bench} (docs/performance.md says how to build one)")
    models = [MODELS.get(m, Path(m)) for m in (a.model or ["smollm2", "gemma3"])]
    tests = [t.strip() for t in a.tests.split(",") if t.strip()]
    caches = [c.strip() for c in a.caches.split(",") if c.strip()]
    variants = [parse_variant(v) for v in a.variant] or [("kvchat", {})]
    for name, env in variants:  # each variant must import its own tree, or the ratio is of one tree
        child_env, tree = variant_env(env)
        check_tree(tree, child_env, tree)
        print(f"  variant {name}: kvchat from {os.path.realpath(tree)}", file=sys.stderr)
    busy = start_busy(a.busy)
    rows = []
    try:
        for model in models:
            for test in tests:
                # depth tests run with every cache type; plain pp / tg with the first (f16) only
                for cache in caches if "@d" in test else caches[:1]:
                    ours = {name: [] for name, _ in variants}
                    theirs = []
                    for r in range(a.rounds):
                        for name, env in variants:
                            if a.page_in:
                                packs = kvchat_packs(model, {**os.environ, **env})
                                paged_in(f"kvchat {name}", packs, packs + [model])
                            ours[name].append(run_kvchat(model, parse_test(test), cache, a.reps, a.threads, env))
                        if a.page_in:
                            paged_in("llama.cpp", [model], [model] + kvchat_packs(model, os.environ))
                        theirs.append(run_llama(a.llama_bench, model, parse_test(test), cache, a.reps, a.threads))
                        got = "  ".join(f"{name} {ours[name][-1]:.1f}" for name, _ in variants)
                        print(
                            f"  {model.name} {test} {cache} round {r + 1}: {got}  llama.cpp {theirs[-1]:.1f}",
                            file=sys.stderr,
                            flush=True,
                        )
                    mt = statistics.median(theirs)
                    for name, _ in variants:
                        mo = statistics.median(ours[name])
                        rows.append((model.name, test, cache, name, mo, mt, mo / mt, ours[name], theirs))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    load = f", {a.busy} busy loop{'s' if a.busy != 1 else ''} running" if a.busy else ""
    print(
        f"rounds {a.rounds}, reps {a.reps}, threads {a.threads}{load}; variants: "
        + "; ".join(f"{n}: {','.join(f'{k}={v}' for k, v in e.items()) or 'defaults'}" for n, e in variants)
    )
    print("| model | test | cache | kvchat | kvchat t/s | llama.cpp t/s | ratio | rounds (kvchat / llama.cpp) |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for name, test, cache, variant, mo, mt, ratio, ours, theirs in rows:
        per = ", ".join(f"{o:.1f}/{t:.1f}" for o, t in zip(ours, theirs))
        print(f"| {name} | {test} | {cache} | {variant} | {mo:.1f} | {mt:.1f} | **{ratio:.2f}×** | {per} |")


if __name__ == "__main__":
    main()
