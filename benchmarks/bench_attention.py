"""Time the attention kernel alone at SmolLM2's shapes (9 query heads, 3 KV heads, head 64).

    python benchmarks/bench_attention.py [--depth 4096] [--reps 20] [--threads N] [--types f16,q8_0]

Cases: one generated token over `depth` cached cells (tg), and a 512-token prompt ubatch on top
of `depth` cells (pp512, causal). Reported: ms per call and ms per token for the 30 layers of
SmolLM2 (tg) — the number to set beside `kvchat bench -n 128 -d <depth>`. The machine is shared:
"cpu" (process time / threads) next to wall time shows how much of the wall time was ours.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from tree_env import use_tree

use_tree(str(ROOT))  # kvchat.* from PYTHONPATH=TREE if given, else this tree

N_HEAD, N_HEAD_KV, HEAD_DIM, N_LAYER = 9, 3, 64, 30


def make_case(type_name: str, n_tokens: int, depth: int, seed: int = 0):
    """Random cache rows of the given type and a causal mask; n_kv padded to 256 like the cache."""
    from kvchat.kernels.ggml_types import GGMLType
    from kvchat.kernels.quants import quantize

    rng = np.random.default_rng(seed)
    t = int(GGMLType[type_name.upper()])
    n_kv = -(-(depth + n_tokens) // 256) * 256
    rows = rng.standard_normal((n_kv, N_HEAD_KV * HEAD_DIM)).astype(np.float32)  # [n_kv, n_embd_k_gqa]
    k = quantize(rows, t).reshape(1, n_kv, -1)  # [1, n_kv, row_bytes] u8
    v = quantize(rows[::-1].copy(), t).reshape(1, n_kv, -1)
    q = rng.standard_normal((n_tokens, N_HEAD, HEAD_DIM)).astype(np.float32)  # [n_tokens, n_head, dk]
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)  # [n_tokens, n_kv]
    for i in range(n_tokens):
        mask[i, : depth + i + 1] = 0.0
    ts = np.zeros(n_tokens, dtype=np.int32)
    return q, k, t, v, mask, ts


def time_case(case, reps: int, n_threads: int):
    from kvchat.kernels.attention import attention

    q, k, t, v, mask, ts = case
    attention(q, k, t, v, t, mask, ts, N_HEAD_KV, 0.125, n_threads=n_threads)  # compile / warm up
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        attention(q, k, t, v, t, mask, ts, N_HEAD_KV, 0.125, n_threads=n_threads)
    return (time.perf_counter() - w0) / reps, (time.process_time() - c0) / reps


def main() -> None:
    import numba

    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp case (0: skip)")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    for tn in a.types.split(","):
        wall, cpu = time_case(make_case(tn, 1, a.depth), a.reps, a.threads)
        print(
            f"tg   {tn:5s} depth {a.depth:5d}: {wall * 1e3:7.3f} ms/call  cpu {cpu * 1e3 / a.threads:7.3f}"
            f"  -> {wall * 1e3 * N_LAYER:6.1f} ms/token over {N_LAYER} layers"
        )
        if a.pp:
            wall, cpu = time_case(make_case(tn, a.pp, a.depth), max(1, a.reps // 10), a.threads)
            print(
                f"pp{a.pp} {tn:5s} depth {a.depth:5d}: {wall * 1e3:7.1f} ms/call  cpu {cpu * 1e3 / a.threads:7.1f}"
                f"  -> {wall * N_LAYER:6.2f} s/ubatch over {N_LAYER} layers"
            )


if __name__ == "__main__":
    main()
