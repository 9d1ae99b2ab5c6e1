"""numba CPU kernels: block formats, matmul, attention, RoPE, norms, activations.

The decode hot path, from the caller down to these kernels (a generated token; a prompt takes
the same path through Context.decode, many tokens per ubatch):

    runtime/context.py       Context.decode_one(token, pos, seq)      | Context.decode(batch)
      runtime/batch.py         OneToken.init: scalar checks            | BatchAllocator.init
      runtime/memory/          memory.init_batch(allocator): the ubatches and their slots, found
                               in a dry run (prepare); per ubatch mctx.apply(), the only mutation
                               of memory (undone by mctx.rollback() if anything fails)
      kernels/launch_tuner.py  decode_one only: the step's matmul threshold, from measured times
      runtime/arch/layer_plan.py  forward(model, ubatch, mctx, min_macs): the one layer loop
        embed                  TokenRows / QMatrix.get_rows (matmul.py)
        per layer, from its LayerPlan:
          attention_step       QMatrix.matmul (matmul.py -> matmul_int.py | matmul_kernels.py)
                               prepare_qkv_store (qkv_store.py: QK-norm + RoPE + K/V cache write,
                                 through mctx.attn_io's store) or rope.py + kv_kernels.py
                               attention_checked (attention.py -> attention_flash.py |
                                 attention_classic.py, over attention_tiles.py)
          output_step          QMatrix.matmul
          residual_norm        fused_norm.py (residual add + RMSNorm of the next norm, norm.py)
          ffn_step             QMatrix.matmul, act.py (SwiGLU / GeGLU), QMatrix.matmul
          (recurrent mixers: conv.py, ssm_scan.py, delta_net.py)
        lm_head                QMatrix.matmul (+ soft-cap)
      -> the logits rows in the Context's output buffer -> runtime/sampling.py

Set before numba is first imported (a user's environment wins):
- the threading layer is pinned to OpenMP: a parallel launch costs ~3 µs with omp against
  ~80 µs with the workqueue layer on this machine, and a token needs ~100 launches;
- GOMP_SPINCOUNT (only when the user set neither it nor OMP_WAIT_POLICY): an idle OpenMP worker
  spins that many pause-loop iterations before it sleeps. libgomp's unit is one `pause` plus a
  load (~31 ns on this Xeon, so SPIN_COUNT is ~0.3 ms): long enough to bridge the gaps between a
  generated token's launches when its layer matmuls run parallel, short enough that a worker is
  asleep between tokens of a loaded machine and while chat waits for input;
- OMP_WAIT_POLICY=passive: with libgomp this makes the spin 0 when the user gives no
  GOMP_SPINCOUNT, and the count used when there are more OpenMP threads than CPUs 0 as well
  (libgomp's env.c: throttled = min(100 or 1000 for unset / active policy, GOMP_SPINCOUNT)), so an
  oversubscribed process never spins. Unbounded spinning (OMP_WAIT_POLICY=active) made every
  launch wait for a descheduled spinner when anything else ran (tg 4–5 against 21–35 t/s at load
  6–8 in session 3); whether a one-token step's matmuls go parallel at all is decided from
  measured step times by kernels/launch_tuner.py. docs/performance.md has the runs.

Importing this package changes nothing in numba itself. What kvchat changes in numba and
llvmlite (cached kernels loaded without the compiler's set-up, cache writes safe for several
processes, the record of a warm-up's kernels) is applied by one explicit call,
`kvchat.kernels.numba_start.install()`, made by the CLI's entry point (kvchat.cli.app.main)
and the compile workers before numba is first imported.
"""

import os

SPIN_COUNT = 10_000  # pause-loop iterations an idle worker spins before it sleeps (see above)

os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
