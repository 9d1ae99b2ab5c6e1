"""numba CPU kernels: block formats, matmul, attention, RoPE, norms, activations.

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
