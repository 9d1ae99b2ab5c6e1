"""numba CPU kernels: block formats, matmul, attention, RoPE, norms, activations.

Set before numba is first imported (a user's environment wins):
- the threading layer is pinned to OpenMP: a parallel launch costs ~3 µs with omp against
  ~80 µs with the workqueue layer on this machine, and a token needs ~100 launches;
- OMP_WAIT_POLICY=passive: idle OpenMP workers sleep instead of spinning. When anything else
  runs on the machine, spinning workers make every launch wait for a descheduled spinner
  (290–730 µs per launch measured under load, 16 µs passive; tg 4–5 against 21–35 t/s at load
  average 6–8 in session 3), while a passive launch costs 11–43 µs — so small kernels run
  serial twins below the thresholds of kernels/parallel.py. docs/performance.md has the runs.
"""
import os

os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from kernels.jit_cache import lean_cache_loads  # noqa: E402 (numba's threading env is set above)

lean_cache_loads()  # cached kernels load without numba's compiler registries (kernels/jit_cache.py)
