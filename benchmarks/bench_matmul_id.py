"""Time ExpertMatrix.matmul_id on one layer's experts of a MoE GGUF: one launch for every selected
expert (kernels/matmul_id_q.py) against one QMatrix.matmul per expert (the path it replaced).

    python benchmarks/bench_matmul_id.py -m MODEL.gguf [--layer 0] [--ns 1,512] [--reps 20]
                                         [--big 3] [--min-macs N] [--seed 0]

For n tokens routed to k of the layer's experts at random (seeded), each repetition runs the
layer's gate|up experts on n rows and its down experts on n * k rows, as the MoE FFN does. Reported
per n and path: the best and median wall ms of a repetition and the best process (CPU) ms, all
threads: on a shared machine the best repetition and the CPU time are the least disturbed. n=1
runs --reps repetitions, larger n --big. --min-macs: the parallel threshold passed to both paths
(default kvchat's; 0 = every launch parallel). Both paths' results are checked bit-identical.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from tree_env import use_tree  # noqa: E402

use_tree(str(ROOT))  # kvchat.* from PYTHONPATH=TREE if given, else this tree


def layer_experts(path: Path, layer: int):
    """(gate|up ExpertMatrix, down ExpertMatrix, k used) of one layer."""
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.model import _experts

    gf = GGUFFile(path)
    arch = gf.get_str("general.architecture")
    n_expert = int(gf.get_int(f"{arch}.expert_count"))
    n_used = int(gf.get_int(f"{arch}.expert_used_count"))
    t = lambda name: gf.tensors[f"blk.{layer}.{name}.weight"]  # noqa: E731
    gate_up = _experts([t("ffn_gate_exps"), t("ffn_up_exps")], n_expert)
    down = _experts([t("ffn_down_exps")], n_expert)
    return gate_up, down, n_used


def per_expert(em, x, ids, min_macs):
    """The replaced path: one QMatrix.matmul per expert on its pairs' rows (views of the stack)."""
    from kvchat.kernels.matmul import QMatrix

    if not hasattr(em, "_bench_own"):
        kind, stack = em.packing()
        em._bench_own = [
            QMatrix(None, em.t, em.k, keep_raw=False, packed=(kind, tuple(a[e] for a in stack)), m=em.m)
            for e in range(em.n_expert)
        ]
    n, n_used = ids.shape
    flat = ids.reshape(-1)
    per_slot = x.ndim == 3
    xr = x.reshape(n * n_used, -1) if per_slot else x
    out = np.empty((n * n_used, em.m), np.float32)
    if n == 1 and not per_slot:
        for s in range(n_used):
            out[s] = em._bench_own[flat[s]].matmul(xr, min_macs)[0]
        return out.reshape(n, n_used, em.m)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=em.n_expert)
    start = 0
    for e in np.flatnonzero(counts):
        pairs = order[start : start + counts[e]]
        start += counts[e]
        rows = xr[pairs] if per_slot else xr[pairs // n_used]
        out[pairs] = em._bench_own[e].matmul(rows, min_macs)
    return out.reshape(n, n_used, em.m)


def one_launch(em, x, ids, min_macs):
    return em.matmul_id(x, ids, min_macs)


def ffn(run, gate_up, down, h, ids, min_macs):
    n, k = ids.shape
    gu = run(gate_up, h, ids, min_macs)  # [n, k, 2f]
    f = gu.shape[-1] // 2
    act = np.ascontiguousarray(gu[:, :, :f])  # the activation's shape only: its values do not matter here
    return gu, run(down, act, ids, min_macs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--ns", default="1,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--big", type=int, default=3)
    ap.add_argument("--min-macs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    gate_up, down, n_used = layer_experts(a.model, a.layer)
    print(f"layer {a.layer}: {gate_up!r}, {down!r}, {n_used} used")
    rng = np.random.default_rng(a.seed)
    for n in (int(v) for v in a.ns.split(",")):
        h = (0.1 * rng.standard_normal((n, gate_up.k))).astype(np.float32)
        ids = np.stack([rng.permutation(gate_up.n_expert)[:n_used] for _ in range(n)]).astype(np.int32)
        results = {}
        for name, run in (("per-expert", per_expert), ("one launch", one_launch)):
            results[name] = ffn(run, gate_up, down, h, ids, a.min_macs)  # warm: loads or compiles
            walls, cpus = [], []
            for _ in range(a.reps if n == 1 else a.big):
                w0, c0 = time.perf_counter(), time.process_time()
                ffn(run, gate_up, down, h, ids, a.min_macs)
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
            best, med, cpu = 1e3 * min(walls), 1e3 * statistics.median(walls), 1e3 * min(cpus)
            print(f"n={n:4d} {name:10s}: wall best {best:8.2f} ms, median {med:8.2f} ms; cpu best {cpu:8.2f} ms")
        for a_, b_ in zip(results["per-expert"], results["one launch"]):
            np.testing.assert_array_equal(a_, b_)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
