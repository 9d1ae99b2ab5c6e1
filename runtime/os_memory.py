"""Keep freed memory out of the resident set (glibc malloc settings; a no-op elsewhere).

Why: loading repacks every weight matrix through ~1-10 MB numpy temporaries. glibc serves an
allocation above its mmap threshold with its own mapping, returned to the OS on free — but it
raises that threshold to the size of each mapping freed (up to 32 MiB), so from the first
repack on, the temporaries come from the heap, interleave with the long-lived repacked arrays,
and their freed pages stay resident (Gemma-3: 21 MB after load, `malloc_trim` gives them back).
A fixed threshold keeps every large array in its own mapping, so freeing it frees its pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD = 256 << 10  # arrays from 256 KiB up get their own mapping (glibc's start: 128 KiB)

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
            except OSError:
                pass
    return _libc


def map_large_allocations() -> None:
    """Fix glibc's mmap threshold (module docstring); later large allocations are mapped."""
    lib = _glibc()
    if lib:
        lib.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc malloc_trim)."""
    lib = _glibc()
    if lib:
        lib.malloc_trim(ctypes.c_size_t(0))
