"""Time the matmuls of one token (n=1) and of one 512-token ubatch on the real models' tensors.

    python benchmarks/bench_matmul.py [--model smollm2|gemma3|all] [--reps 20] [--threads N] [--cold]

Every 2-D weight of the model is wrapped in a QMatrix (the tied token embedding doubles as the
output matrix, as in the forward pass) and multiplied once per token. Reported: ms per token,
GFLOP/s-equivalent (2·m·k per token and matrix), and per weight type (the best repetition, the
least disturbed by other processes on a shared machine). --cold compiles the
kernels into an empty numba cache first and reports the compile time. The machine is shared:
"cpu" (process time) next to wall time shows how much of the wall time was ours.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = {
    "smollm2": Path.home() / ".cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": Path.home() / ".cache/kvchat/models/gemma-3-270m-q4_k_m.gguf",
}


def load(path: Path):
    from kernels.matmul import QMatrix
    from runtime.gguf_file import GGUFFile

    gf = GGUFFile(path)
    mats = []
    t0 = time.perf_counter()
    for name, ti in gf.tensors.items():
        if len(ti.shape) == 2 and (name.startswith("blk.") or name in ("token_embd.weight", "output.weight")):
            mats.append((name, QMatrix(ti.data, ti.ggml_type, int(ti.shape[0]))))
    return mats, time.perf_counter() - t0


def bench(mats, n: int, reps: int):
    import numpy as np

    from kernels.ggml_types import GGMLType

    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((n, k)).astype(np.float32) for k in {q.k for _, q in mats}}
    for _, q in mats[:8]:
        q.matmul(xs[q.k])  # warm up: compile or load from cache
    by_type: dict[str, list[float]] = {}  # type -> [best seconds per rep, flops per rep]
    t0 = time.perf_counter()
    c0 = time.process_time()
    best = float("inf")
    for _ in range(reps):
        per_rep: dict[str, float] = {}
        t2 = time.perf_counter()
        for name, q in mats:
            t1 = time.perf_counter()
            q.matmul(xs[q.k])
            per_rep[GGMLType(q.t).name] = per_rep.get(GGMLType(q.t).name, 0.0) + time.perf_counter() - t1
        best = min(best, time.perf_counter() - t2)
        for t, dt in per_rep.items():
            e = by_type.setdefault(t, [float("inf"), 0.0])
            e[0] = min(e[0], dt)
    for _, q in mats:
        by_type[GGMLType(q.t).name][1] += 2.0 * q.m * q.k * n
    total = (time.perf_counter() - t0) / reps
    cpu = (time.process_time() - c0) / reps
    flops = sum(2.0 * q.m * q.k * n for _, q in mats)
    return total, cpu, best, flops, {t: (v[0], v[1] / v[0] / 1e9) for t, v in by_type.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="all", choices=["all", *MODELS])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--big", type=int, default=1, help="repetitions of the n=512 call set (0: skip)")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default: all)")
    ap.add_argument("--cold", action="store_true", help="compile into an empty numba cache, report the time")
    args = ap.parse_args()
    if args.cold:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvchat-numba-")
    t0 = time.perf_counter()
    import numpy as np

    from kernels.matmul import QMatrix

    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    for t, k, rb in ((8, 32, 34), (3, 32, 20), (0, 1, 4)):  # i8, nib, f32 kernels, both paths
        q = QMatrix(np.zeros((1, rb), np.uint8), t, k)
        q.matmul(np.zeros((1, k), np.float32))
        q.matmul(np.zeros((16, k), np.float32))
    print(f"import + kernel {'compile' if args.cold else 'load'}: {time.perf_counter() - t0:.1f} s")

    for key in MODELS if args.model == "all" else [args.model]:
        mats, t_load = load(MODELS[key])
        packed = sum(q.packed_nbytes for _, q in mats) / 2**20
        print(f"\n{key}: {len(mats)} matrices, {sum(q.nbytes for _, q in mats) / 2**20:.0f} MiB in file, "
              f"{packed:.0f} MiB repacked, repack {t_load:.1f} s")
        for n, reps in ((1, args.reps), (512, args.big)):
            if reps == 0:
                continue
            total, cpu, best, flops, per = bench(mats, n, reps)
            print(f"  n={n:<4} {total * 1e3:9.1f} ms per call set  {total * 1e3 / n:7.2f} ms/token  "
                  f"{flops / total / 1e9:6.1f} GFLOP/s  ({n / total:.0f} tokens/s matmul-only)  "
                  f"cpu {cpu * 1e3 / n:.2f} ms/token  best rep {best * 1e3 / n:.2f} ms/token")
            print("         per type, best rep:")
            for t, (dt, gf) in sorted(per.items()):
                print(f"         {t:6s} {dt * 1e3:8.2f} ms  {gf:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
