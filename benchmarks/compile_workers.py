"""Compiling a run's kernels on an empty numba cache: in-process (the warm-up compiles them as it
calls them: kvchat before #23) against N compile workers (kvchat.runtime.startup.compile_ahead), side by
side, rounds alternated, each variant in a fresh process with a fresh NUMBA_CACHE_DIR.

    python benchmarks/compile_workers.py -m smollm2 --workers 0 1 2 -r 2

0 is in-process. Prints each round's wall time, the plan's share (worker 0 loading the model and
running the dry run) and the workers' summed compile CPU, then medians; --json FILE keeps every
round with each kernel's compile (wall, CPU) seconds. The ideal for N workers is
max(sum of compile CPU / N, the longest compile) after the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from kvchat.kernels.numba_start import install
install()
from kvchat.cli.options import ChatSettings
from kvchat.cli.sources.models import resolve_model
model, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
path = str(resolve_model(model, None))
cparams = ChatSettings(model=model).context_params(n_seq_max=1, kv_unified=True)
if n == 0:
    from kvchat.runtime.context import Context
    from kvchat.runtime.generate import warm_up
    from kvchat.runtime.model import Model
    m = Model.load(path)
    ctx = Context(m, cparams)
    bos = getattr(m.vocab, "bos", None)
    warm_up(ctx, bos if bos is not None and bos >= 0 else 0, n_prompt=64)
    res = dict(wall=time.perf_counter() - t0, plan=0.0, kernels=[], errors=[])
else:
    from kvchat.runtime.startup.compile_ahead import CompileAhead
    ca = CompileAhead(path, cparams, n_workers=n).start()
    ca.wait()
    kernels = [(f"{e[0]}.{e[1]}", w, c) for e, (w, c) in ca.seconds.items()]
    res = dict(wall=time.perf_counter() - t0, plan=ca.plan_seconds, kernels=kernels, errors=ca.errors)
json.dump(res, open(out, "w"))
"""


def one(model: str, n: int) -> dict:
    cache = tempfile.mkdtemp(prefix="kvchat-cw-")
    out = os.path.join(cache, "result.json")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=ROOT)
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CHILD, model, str(n), out], env=env, cwd=ROOT, check=True)
        res = json.load(open(out))
        res["outer_wall"] = time.perf_counter() - t0
        return res
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("-r", "--rounds", type=int, default=1)
    ap.add_argument("--json")
    opts = ap.parse_args()
    rounds = {n: [] for n in opts.workers}
    for r in range(opts.rounds):
        order = opts.workers if r % 2 == 0 else list(reversed(opts.workers))
        for n in order:
            res = one(opts.model, n)
            rounds[n].append(res)
            cpu = sum(c for _, _, c in res["kernels"])
            longest = max((c for _, _, c in res["kernels"]), default=0.0)
            print(
                f"round {r + 1}: workers {n}: wall {res['outer_wall']:.1f} s, plan {res['plan']:.1f} s, "
                f"{len(res['kernels'])} kernels, compile CPU {cpu:.1f} s (longest {longest:.1f} s)"
                + (f", errors {res['errors']}" if res["errors"] else ""),
                file=sys.stderr,
                flush=True,
            )
    print(f"{'variant':12s} {'wall (median, s)':>17s}   rounds")
    for n, rs in rounds.items():
        walls = [x["outer_wall"] for x in rs]
        label = "in-process" if n == 0 else f"{n} worker" + ("s" if n > 1 else "")
        print(f"{label:12s} {statistics.median(walls):17.1f}   {' '.join(f'{w:.1f}' for w in walls)}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({str(n): rs for n, rs in rounds.items()}, f, indent=1)


if __name__ == "__main__":
    main()
