"""One-token decode: its time, the time outside the matmuls, and a grouped profile.

Usage: python benchmarks/decode_overhead.py MODEL [--stub-matmul] [--profile] [-n 64]
  --stub-matmul  QMatrix.matmul returns fixed random values: what is left is the per-layer work around the
                 matmuls (norms, RoPE, KV writes, attention, Python, numba dispatch)
  --profile      cProfile tottime per token, grouped by what the time is spent on
Prints ms/token (wall and CPU, medians of 7 runs of n tokens). On a shared machine compare two
trees by running this alternately in each (PYTHONPATH=tree: that tree's code is measured, whichever
tree this file is in; benchmarks/tree_env.py maps kvchat.* onto it), and trust the CPU column.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tree_env import use_tree  # noqa: E402

# PYTHONPATH=TREE picks the tree measured, not this file's (tree_env maps kvchat.* onto it)
TREE = use_tree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

GROUPS = [
    ("matmul kernels (numba)", ("matmul_q_serial", "matmul_q", "matmul_blocks")),
    ("QMatrix.matmul wrapper", ("matmul.py:matmul", "matmul.py:_prepared", "_numba_type_")),
    ("attention kernel", ("_flash_attn", "_classic_attn", "classic_attn")),
    (
        "attention wrapper + thread count",
        (
            "attention.py:attention",
            "attention_checked",
            "_launch_plan",
            "flash_plan",
            "_partials",
            "_values_per_bytes",
            "get_num_threads",
            "_launch_threads",
            "attend_io",
        ),
    ),
    ("norms (rms_norm / fused)", ("rms_norm", "fused_norm")),
    (
        "RoPE + QK split + KV write (fused or not)",
        (
            "prepare_qkv",
            "_prep_qkv",
            "_prep_store",
            "_theta_scale",
            "_factors",
            "rope_args",
            "rope_plan",
            "attention_plan",
        ),
    ),
    (
        "KV cache write + mask + memory accessors",
        (
            "cpy_k",
            "cpy_v",
            "scatter_rows",
            "kq_mask",
            "get_k",
            "get_v",
            "get_rot",
            "kq_start",
            "attn_io",
            "_build_mask",
        ),
    ),
    ("GLU", ("glu", "swiglu", "geglu")),
    ("embedding", ("get_rows", "dequant", "embed")),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--stub-matmul", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import kvchat.kernels.matmul as km
    from kvchat.cli.sources.models import resolve_model
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import generate
    from kvchat.runtime.model import Model

    assert os.path.realpath(km.__file__).startswith(TREE + os.sep), (km.__file__, TREE)
    print(f"tree {TREE}", file=sys.stderr)
    m = Model.load(resolve_model(a.model))
    ctx = Context(m, ContextParams(n_ctx=max(512, a.n + 1)))
    if a.stub_matmul:  # fixed normal values, not zeros: an activation of 0 can take a short path
        outs = {}

        def stub(self, x, min_macs=None):
            key = (x.shape[0], self.m)
            if key not in outs:
                outs[key] = np.random.default_rng(self.m).standard_normal(key).astype(np.float32)
            return outs[key].copy()

        km.QMatrix.matmul = stub
    rng = np.random.default_rng(0)

    def run():
        ctx.memory.clear(True)
        toks = [int(t) for t in rng.integers(0, m.hparams.n_vocab, a.n)]
        src = iter(toks[1:] + toks[:1])
        for _ in generate(ctx, lambda logits: next(src), prompt=toks[:1], pos0=0, max_tokens=a.n):
            pass

    run()  # compile / load kernels, touch the weights
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        run()
        pr.disable()
        per_token = 1e3 / a.n
        tot = dict.fromkeys([g for g, _ in GROUPS], 0.0)
        other = total = calls = 0.0
        for (f, _, fn), (_, nc, tt, _, _) in pstats.Stats(pr).stats.items():
            key = f"{f.rsplit('/', 1)[-1]}:{fn}"
            total, calls = total + tt, calls + nc
            group = next((g for g, pats in GROUPS if any(p in key for p in pats)), None)
            if group is None:
                other += tt
            else:
                tot[group] += tt
        for g, _ in GROUPS:
            print(f"| {g} | {tot[g] * per_token:.2f} |")
        print(f"| everything else (forward, blocks, batch, memory, sampling loop) | {other * per_token:.2f} |")
        print(f"| total (profiled), ms/token | {total * per_token:.2f} |")
        print(f"| function calls per token | {calls / a.n:.0f} |")
        return
    wall, cpu = [], []
    for _ in range(7):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        wall.append((time.perf_counter() - t0) / a.n * 1e3)
        cpu.append((time.process_time() - c0) / a.n * 1e3)
    print(
        f"{a.model}: ms/token wall {sorted(wall)[3]:.3f} cpu {sorted(cpu)[3]:.3f}"
        + (" (matmuls stubbed)" if a.stub_matmul else "")
    )


if __name__ == "__main__":
    main()
