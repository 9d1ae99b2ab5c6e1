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
"""

import os

SPIN_COUNT = 10_000  # pause-loop iterations an idle worker spins before it sleeps (see above)

os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import sys  # noqa: E402


def _import_numba_without_yaml() -> None:
    """numba imports PyYAML at start-up (~0.01 s) only to read a `.numba_config.yaml` in the
    working directory; with no such file there is nothing for it to read, so it is imported as
    if PyYAML were absent (a file, or numba already imported: numba's own way)."""
    if "numba" in sys.modules or "yaml" in sys.modules or os.path.exists(".numba_config.yaml"):
        return
    sys.modules["yaml"] = None  # `import yaml` raises ImportError
    try:
        import numba.core.config  # noqa: F401
    finally:
        del sys.modules["yaml"]


from kvchat.kernels import numba_start  # noqa: E402

numba_start.lazy_metadata()  # importlib.metadata runs when numba's extension scan needs it
_import_numba_without_yaml()

from kvchat.kernels.jit_cache import lean_cache_loads  # noqa: E402 (numba's threading env is set above)

lean_cache_loads()  # cached kernels load without numba's compiler registries (kernels/jit_cache.py)
numba_start.cheap_extension_scan()  # and the rest of kernels/numba_start.py
numba_start.arrays_typed_without_numpy_ma()
numba_start.dispatchers_made_cheaply()
numba_start.llvm_lock_events_when_listened()

from kvchat.kernels import warm_set  # noqa: E402

warm_set.install()  # which kernels a warm-up loaded (the CLI skips a warm-up that cannot compile)
