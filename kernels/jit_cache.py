"""Whether numba's on-disk cache already holds our kernels: a first run can say it is compiling.

numba compiles a kernel on its first call and keeps the machine code on disk (cache=True), so
only the first run on a machine — or the first after kvchat's kernels changed — spends minutes
compiling; every later start loads the cached code in milliseconds. The CLI asks
`kernels_compiled()` before it loads a model and, when it says no, words its spinner as
"compiling kernels, first run only…" rather than leaving a long wait unexplained.

The probe reads the cache index of one kernel every forward pass calls (the integer matmul):
numba's index is empty or missing when nothing was compiled, when the kernel's source changed
since (the stamp differs) or when another numba version wrote it — exactly the cases in which
the run is about to compile. It only reads a small pickle; nothing is compiled or loaded.
"""
from __future__ import annotations


def kernels_compiled() -> bool:
    """True when numba's cache holds a compiled version of the hot-path kernels for this source."""
    try:
        from kernels.matmul_int import matmul_q_serial
        cache_file = matmul_q_serial._cache._cache_file  # numba's IndexDataCacheFile
        return bool(cache_file._load_index())
    except Exception:  # another numba layout, an unreadable cache dir: assume warm, stay quiet
        return True
