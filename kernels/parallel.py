"""When a kernel runs on several threads: the one table of parallel-work thresholds.

A numba ``prange`` launch wakes the OpenMP pool, which sleeps between launches
(``OMP_WAIT_POLICY=passive``, kernels/__init__.py): 15-40 µs on this 2-core machine when it is
shared, more than a small kernel's whole run. So each kernel with a serial twin runs the twin
below its threshold; results are bit-identical either way (every kernel's array_equal tests).
Units are in each name; measurements are in docs/performance.md.
"""
import os

MATMUL_PAR_MIN_MACS = int(os.environ.get("KVCHAT_MATMUL_PAR_MIN_MACS", 4_000_000))  # n * m * k of one matmul
