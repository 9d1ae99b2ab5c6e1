"""numba's on-disk kernel cache: whether it is warm (the CLI's first-run wording), and loading
from it without numba's compiler set-up.

numba compiles a kernel on its first call and keeps the machine code on disk (cache=True), so
only the first run on a machine — or the first after kvchat's kernels changed — spends minutes
compiling; every later start loads the cached code in milliseconds. The CLI asks
`kernels_compiled()` before it loads a model and, when it says no, words its spinner as
"compiling kernels, first run only…" rather than leaving a long wait unexplained.

The probe reads the cache index of one kernel every forward pass calls (the integer matmul):
numba's index is empty or missing when nothing was compiled, when the kernel's source changed
since (the stamp differs) or when another numba version wrote it — exactly the cases in which
the run is about to compile. It only reads a small pickle; nothing is compiled or loaded.

`lean_cache_loads()` (installed by kernels/__init__.py): numba's `Cache.load_overload` refreshes
the CPU target before every cache lookup, and the first refresh imports every lowering registry
numba has (numpy linalg, random generators, typed containers, jitclass, ...) — what *compiling*
needs, not loading: 0.23 s and 43 MiB resident measured on this machine, a sixth of a warm
`kvchat run`'s start. A cached kernel only needs its machine code linked and the NRT's C helpers
registered (rtsys.initialize). A cache miss still compiles as before: numba's compiler refreshes
the target itself (CompilerBase.__init__) before typing anything.
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


def lean_cache_loads() -> bool:
    """Make numba's cache loads skip the target refresh (module docstring). True when installed;
    False (numba left as it is) when this numba's Cache lacks the methods it relies on."""
    from numba.core import caching
    from numba.core.runtime import nrt

    cache = caching.Cache
    if getattr(cache.load_overload, "_kvchat_lean", False):
        return True
    if not all(hasattr(cache, a) for a in ("load_overload", "_load_overload",
                                            "_guard_against_spurious_io_errors")) \
            or not hasattr(nrt.rtsys, "initialize"):
        return False

    def load_overload(self, sig, target_context):
        nrt.rtsys.initialize(target_context)  # the NRT symbols cached code links against
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
        return None  # the guard swallowed a spurious I/O error: compile instead

    load_overload._kvchat_lean = True
    load_overload.__doc__ = cache.load_overload.__doc__
    cache.load_overload = load_overload
    return True
