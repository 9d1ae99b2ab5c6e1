"""Time QMatrix.matmul on the real models' weights: one token (generation) and token batches (prefill).

    python benchmarks/bench_matmul.py [--model smollm2|gemma3|all] [--ns 1,512] [--reps 20]
                                      [--big 1] [--threads N] [--cold] [--check]

Every 2-D weight of the model is wrapped in a QMatrix (the tied token embedding doubles as the
output matrix, as in the forward pass) and multiplied once per "call set". Reported per n:
wall ms per call set and per token, GFLOP/s-equivalent (2·m·k per token and matrix), process
time ("cpu", all threads), and per weight type the best repetition of wall and of process time
(the least disturbed by other processes on a shared machine; with --threads 1 the process time
is the kernel's own time). n=1 runs --reps repetitions, larger n --big.

--cold compiles the kernel into an empty numba cache first and reports the compile time.
--check asserts the batch invariance on the real weights: every row of an n=64 product is
bit-identical to the n=1 product of that row (kernels/matmul_kernels.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from tree_env import use_tree

use_tree(str(ROOT))  # kvchat.* from PYTHONPATH=TREE if given, else this tree
MODELS = {
    "smollm2": Path.home() / ".cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": Path.home() / ".cache/kvchat/models/gemma-3-270m-q4_k_m.gguf",
}


def load(path: Path):
    from kvchat.kernels.matmul import QMatrix
    from kvchat.runtime.gguf.file import GGUFFile

    gf = GGUFFile(path)
    mats = []
    t0 = time.perf_counter()
    for name, ti in gf.tensors.items():
        if len(ti.shape) == 2 and (name.startswith("blk.") or name in ("token_embd.weight", "output.weight")):
            mats.append((name, QMatrix(ti.data, ti.ggml_type, int(ti.shape[0]))))
    return mats, time.perf_counter() - t0


def bench(mats, n: int, reps: int):
    """-> wall s per call set (mean), process s (mean), best wall s, flops, {type: (best wall, best cpu, flops)}."""
    import numpy as np

    from kvchat.kernels.ggml_types import GGMLType

    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((n, k)).astype(np.float32) for k in {q.k for _, q in mats}}
    for _, q in mats[:8]:
        q.matmul(xs[q.k])  # warm up: load the kernel from the cache
    by_type: dict[str, list[float]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    best = float("inf")
    for _ in range(reps):
        per_rep: dict[str, list[float]] = {}
        t2 = time.perf_counter()
        for _, q in mats:
            t1, c1 = time.perf_counter(), time.process_time()
            q.matmul(xs[q.k])
            e = per_rep.setdefault(GGMLType(q.t).name, [0.0, 0.0])
            e[0] += time.perf_counter() - t1
            e[1] += time.process_time() - c1
        best = min(best, time.perf_counter() - t2)
        for t, (dt, dc) in per_rep.items():
            e = by_type.setdefault(t, [float("inf"), float("inf"), 0.0])
            e[0], e[1] = min(e[0], dt), min(e[1], dc)
    total = (time.perf_counter() - t0) / reps
    cpu = (time.process_time() - c0) / reps
    for _, q in mats:
        by_type[GGMLType(q.t).name][2] += 2.0 * q.m * q.k * n
    flops = sum(2.0 * q.m * q.k * n for _, q in mats)
    return total, cpu, best, flops, by_type


def check_invariance(mats) -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    for name, q in mats:
        x = rng.standard_normal((64, q.k)).astype(np.float32)
        y = q.matmul(x)
        for i in (0, 1, 5, 62, 63):
            assert np.array_equal(y[i], q.matmul(x[i])), f"{name}: row {i} of n=64 differs from n=1"
    print(f"  batch invariance: {len(mats)} matrices, rows of n=64 == n=1 bit for bit")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="all", choices=["all", *MODELS])
    ap.add_argument("--ns", default="1,512", help="token counts, comma-separated")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of the n=1 call set")
    ap.add_argument("--big", type=int, default=1, help="repetitions of the call sets with n > 1 (0: skip)")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default: all)")
    ap.add_argument("--cold", action="store_true", help="compile into an empty numba cache, report the time")
    ap.add_argument("--check", action="store_true", help="assert batch invariance on the real weights")
    args = ap.parse_args()
    if args.cold:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvchat-numba-")
    t0 = time.perf_counter()
    import numpy as np

    from kvchat.kernels.matmul import QMatrix

    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    for t, k, rb in ((8, 32, 34), (3, 32, 20), (0, 1, 4), (12, 256, 144)):  # i8, nib, f32, f32 scales
        QMatrix(np.zeros((1, rb), np.uint8), t, k).matmul(np.zeros((1, k), np.float32))
    print(f"import + kernel {'compile' if args.cold else 'load'}: {time.perf_counter() - t0:.1f} s")

    for key in MODELS if args.model == "all" else [args.model]:
        mats, t_load = load(MODELS[key])
        packed = sum(q.packed_nbytes for _, q in mats) / 2**20
        print(
            f"\n{key}: {len(mats)} matrices, {sum(q.nbytes for _, q in mats) / 2**20:.0f} MiB in file, "
            f"{packed:.0f} MiB repacked, repack {t_load:.1f} s"
        )
        if args.check:
            check_invariance(mats)
        for n in (int(v) for v in args.ns.split(",")):
            reps = args.reps if n == 1 else args.big
            if reps == 0:
                continue
            total, cpu, best, flops, per = bench(mats, n, reps)
            print(
                f"  n={n:<4} {total * 1e3:9.1f} ms per call set  {total * 1e3 / n:7.2f} ms/token  "
                f"{flops / total / 1e9:6.1f} GFLOP/s  ({n / total:.0f} tokens/s matmul-only)  "
                f"cpu {cpu * 1e3 / n:.2f} ms/token  best rep {best * 1e3 / n:.2f} ms/token"
            )
            print("         per type, best rep:       wall              cpu")
            for t, (dt, dc, fl) in sorted(per.items()):
                print(
                    f"         {t:6s} {dt * 1e3:9.2f} ms {fl / dt / 1e9:6.1f} GFLOP/s"
                    f"  {dc * 1e3:9.2f} ms {fl / max(dc, 1e-9) / 1e9:6.1f} GFLOP/s"
                )


if __name__ == "__main__":
    main()
