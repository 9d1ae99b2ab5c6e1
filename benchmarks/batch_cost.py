"""The cost of an n-token batch (every row an output) against n one-token decodes, n = 1..8.

Usage: python benchmarks/batch_cost.py MODEL [--nmax 8] [--rounds 5] [--ctx 512]
A speculative verify decodes the sampled token and its drafts in one batch with every row
output; it wins only if that batch costs little more than one token. After a 64-token prompt
and 24 one-token steps (the launch tuner picks its arm), for each n: the verify batch of n
tokens with all logits (Context.decode_tuned, as speculative decoding runs it), n one-token
decodes (Context.decode_one) and the same batch through decode() with the configured thresholds,
each followed by seq_rm, alternated, medians of `rounds`. Prints ms and the ratio to one token.
"""

import argparse
import os
import sys
import time

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--nmax", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ctx", type=int, default=512)
    a = ap.parse_args()
    from kvchat.runtime.batch import Batch
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_tokens
    from kvchat.runtime.model import Model

    model = Model.load(a.model)
    ctx = Context(model, ContextParams(n_ctx=a.ctx))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 1000, 64).tolist()
    decode_tokens(ctx, prompt, 0, logits="none")
    p0 = len(prompt)
    toks = rng.integers(100, 1000, a.nmax).astype(np.int32)

    def batch(n, tuned=True):
        b = Batch.one_seq(toks[:n], p0, 0, all_logits=True)
        t = time.perf_counter()
        assert (ctx.decode_tuned(b) if tuned else ctx.decode(b)) == 0
        dt = time.perf_counter() - t
        ctx.memory.seq_rm(0, p0, -1)
        return dt

    def singles(n):
        t = time.perf_counter()
        for i in range(n):
            assert ctx.decode_one(int(toks[i]), p0 + i, 0) == 0
        dt = time.perf_counter() - t
        ctx.memory.seq_rm(0, p0, -1)
        return dt

    for _ in range(24):  # let the launch tuner choose its arm for one-token steps
        singles(1)
    for n in range(1, a.nmax + 1):  # warm every shape
        batch(n)
        batch(n, False)
    res = {n: ([], [], []) for n in range(1, a.nmax + 1)}
    for _ in range(a.rounds):
        for n in range(1, a.nmax + 1):
            res[n][0].append(batch(n))
            res[n][1].append(singles(n))
            res[n][2].append(batch(n, False))
    one = np.median(res[1][1])
    arm = ("serial", "parallel")[ctx.launch.arm]
    print(f"{os.path.basename(a.model)}: one-token decode {one * 1e3:.2f} ms (launch tuner's arm: {arm})")
    print(
        "| n | verify batch of n, all rows (ms) | n one-token decodes (ms) | verify / one token "
        "| decode() as configured (ms) |"
    )
    print("|---|---|---|---|---|")
    for n in range(1, a.nmax + 1):
        b, s, c = (np.median(r) for r in res[n])
        print(f"| {n} | {b * 1e3:.2f} | {s * 1e3:.2f} | {b / one:.2f} | {c * 1e3:.2f} |")


if __name__ == "__main__":
    main()
