"""numba CPU kernels: block formats, matmul, attention, RoPE, norms, activations.

Set before numba is first imported (a user's environment wins):
- the threading layer is pinned to OpenMP: a parallel launch costs ~3 µs with omp against
  ~80 µs with the workqueue layer on this machine, and a token needs ~100 launches;
- OMP_WAIT_POLICY=passive: idle OpenMP workers sleep instead of spinning. Spinning workers
  steal the cores from OpenBLAS during prefill (pp512 187 -> 302 t/s with passive, SmolLM2,
  idle 2-core machine) and, when anything else runs, make every launch wait for a descheduled
  spinner (290–730 µs per launch measured under load, 16 µs passive); generation on an idle
  machine is within noise (tg128 57 ± 9 vs 53 ± 4 t/s). docs/performance.md has the runs.
"""
import os

os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
