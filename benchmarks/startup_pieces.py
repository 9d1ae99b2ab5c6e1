"""What each start-up piece of kernels/numba_start.install() (and cli/fast_args.py) saves, measured
on the operation it changes, in fresh processes, with and without the piece, rounds alternated:

    python benchmarks/startup_pieces.py -r 15

Each probe is a short `python -c` that installs the pieces (all, or all but one via
KVCHAT_STARTUP_SKIP), then times (CPU: time.process_time; wall: perf_counter) only the step the
piece is for: numba's extension scan at the first kernel load (cheap_extension_scan), typing the
first array (arrays_typed_without_numpy_ma), importing the engine's kernel modules
(dispatchers_made_cheaply: their decorations), a warm-up of smollm2 on cached kernels
(lean_cache_loads: needs a warm cache), and parsing a `kvchat run` line (fast_args; fast_params:
a line typer parses). The pieces removed in #23 were measured the same way before they went
(importing numba for the LazyLoader importlib.metadata and PyYAML hidden; 1100 llvmlite calls for
the llvm_lock events). A short step is less exposed to a busy machine than a whole
start, so these resolve savings of a few ms that benchmarks/startup.py cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRE = "import os, sys, time\nfrom kvchat.kernels.numba_start import install\n"
T = "t0, c0 = time.perf_counter(), time.process_time()\n"
OUT = "print(time.perf_counter() - t0, time.process_time() - c0)\n"

PROBES = {
    # piece -> (code before the timed step, timed step)
    "cheap_extension_scan": (
        "install()\nimport numba\nfrom numba.core import entrypoints\n",
        "entrypoints.init_all()\n",
    ),
    "arrays_typed_without_numpy_ma": (
        "install()\nimport numba, numpy as np\na = np.zeros(4, np.float32)\n",
        "numba.typeof(a)\n",
    ),
    "dispatchers_made_cheaply": (
        "install()\nimport numba, numpy\n",
        "import kvchat.runtime.model, kvchat.runtime.context, kvchat.kernels.attention_classic\n",
    ),
    "lean_cache_loads": (
        "install()\nfrom kvchat.runtime.model import Model\nm = Model.load(sys.argv[1])\n",
        "from kvchat.runtime.context import Context\nfrom kvchat.runtime.generate import warm_up\n"
        "warm_up(Context(m), 1, n_prompt=2)\n",
    ),
    "fast_args": (
        "install()\nfrom kvchat.cli import app\nimport kvchat.cli.commands.run as r\n"
        "r.run_command = lambda settings, **own: 0\n",
        "app.main(['run', '-m', 'x', '-p', 'hi', '-n', '16'])\n",
    ),
    "fast_params": (
        "install()\nfrom kvchat.cli import app\nimport kvchat.cli.commands.run as r\n"
        "r.run_command = lambda settings, **own: 0\n",
        "app.main(['run', '-m', 'x', '-p', 'hi', '-n', '16', '--temp=0.5'])\n",
    ),
}


def probe(piece: str, skip: bool, model: str) -> tuple[float, float]:
    before, step = PROBES[piece]
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if skip:
        env["KVCHAT_STARTUP_SKIP"] = piece
    code = PRE + before + T + step + OUT
    out = subprocess.run(
        [sys.executable, "-c", code, model], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[-2]), float(out[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--rounds", type=int, default=11)
    ap.add_argument("--pieces", nargs="*", default=list(PROBES))
    ap.add_argument("-m", "--model", default="smollm2", help="for lean_cache_loads (its kernels cached)")
    opts = ap.parse_args()
    sys.path.insert(0, ROOT)
    from kvchat.cli.sources.models import resolve_model

    model = str(resolve_model(opts.model, None))
    print(f"{'piece':32s} {'CPU with':>9s} {'without':>9s} {'saves':>8s}   {'wall with':>9s} {'without':>9s}  (ms)")
    for piece in opts.pieces:
        got = {True: [], False: []}
        for r in range(opts.rounds):
            for skip in (False, True) if r % 2 == 0 else (True, False):
                got[skip].append(probe(piece, skip, model))
        cpu = {k: statistics.median(c for _, c in v) * 1e3 for k, v in got.items()}
        wall = {k: statistics.median(w for w, _ in v) * 1e3 for k, v in got.items()}
        print(
            f"{piece:32s} {cpu[False]:9.1f} {cpu[True]:9.1f} {cpu[True] - cpu[False]:8.1f}   "
            f"{wall[False]:9.1f} {wall[True]:9.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
