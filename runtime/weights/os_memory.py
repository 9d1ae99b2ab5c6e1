"""Keep freed memory out of the resident set (glibc malloc settings, LLVM's library pages;
a no-op elsewhere).

Why: loading repacks every weight matrix through ~1-10 MB numpy temporaries. glibc serves an
allocation above its mmap threshold with its own mapping, returned to the OS on free — but it
raises that threshold to the size of each mapping freed (up to 32 MiB), so from the first
repack on, the temporaries come from the heap, interleave with the long-lived repacked arrays,
and their freed pages stay resident (Gemma-3: 21 MB after load, `malloc_trim` gives them back).
A fixed threshold keeps every large array in its own mapping, so freeing it frees its pages.

After the load the threshold is raised again (`heap_for_step_arrays`): with it fixed at 256 KiB
a decode step's arrays each got a fresh mapping, and touching one costs a page fault per 4 KiB
page (expensive in this VM): Gemma-3 270M's two 1 MiB logits rows took 515 faults and 1-2.5 ms
of a ~15 ms token; a 512-token prompt ~110 000 faults (SmolLM2 pp512 242 -> 361 t/s without
them; docs/performance.md, session 14). From the heap they reuse the last step's pages.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 10  # arrays from 256 KiB up get their own mapping (glibc's start: 128 KiB)
TRIM_THRESHOLD = 128 << 10  # glibc's default: a free heap top above this goes back to the OS
# after a load: glibc's own defaults as its dynamic threshold reaches them (the largest it moves to,
# DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and twice that kept as free heap top)
STEP_MMAP_THRESHOLD = 32 << 20  # arrays under 32 MiB (a step's logits, a prompt's activations) from the heap
STEP_TRIM_THRESHOLD = 64 << 20

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(None)  # the process's own symbols: libc's (no ldconfig run)
                _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
            except OSError:
                pass
    return _libc


def _set(mmap_threshold: int, trim_threshold: int) -> None:
    lib = _glibc()
    if lib:
        lib.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(mmap_threshold))
        lib.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(trim_threshold))


def map_large_allocations() -> None:
    """Fix glibc's mmap threshold for a load (module docstring); later large allocations are mapped."""
    _set(MMAP_THRESHOLD, TRIM_THRESHOLD)


def heap_for_step_arrays() -> None:
    """After a load (module docstring): arrays under STEP_MMAP_THRESHOLD come from the heap, and
    a free heap top up to STEP_TRIM_THRESHOLD stays, so a decode step's arrays reuse the last
    step's pages instead of faulting in fresh ones. (glibc's own dynamic threshold would do the
    same, but a mallopt setting switches it off for the process.)"""
    _set(STEP_MMAP_THRESHOLD, STEP_TRIM_THRESHOLD)


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc malloc_trim)."""
    lib = _glibc()
    if lib:
        lib.malloc_trim(ctypes.c_size_t(0))


_MADV_DONTNEED = 4
LIBRARIES = ("libllvmlite",)  # shared libraries whose clean pages leave once the kernels are linked


def release_library_pages(names=LIBRARIES) -> int:
    """Drop the clean file pages of the named shared libraries from the resident set; returns
    the bytes released (Linux; 0 elsewhere).

    Why: LLVM (libllvmlite.so, 179 MB) is needed to link the cached kernels at start-up and then
    hardly ever again, but the pages its loader and linker touched stay mapped — ~35 MiB of the
    process's resident set for the whole run. Only mappings that are not writable and hold no
    private (copy-on-write) page are released, so nothing but the file's own bytes is dropped: a
    page read later faults back in from the page cache (MADV_DONTNEED on a private file
    mapping). Relocated read-only data (RELRO) is private and stays. The mappings come from
    /proc/self/maps and their pages' kinds from /proc/self/pagemap (a few hundred KB for these
    mappings; /proc/self/smaps, which walks every mapping of the process, took 5-20 ms), or from
    smaps where pagemap cannot be read."""
    if not sys.platform.startswith("linux"):
        return 0
    lib = _glibc()
    if not lib or not hasattr(lib, "madvise"):
        return 0
    try:
        ranges = _clean_ranges_pagemap(names)
    except OSError:
        ranges = _clean_ranges_smaps(names)
    released = 0
    for lo, hi, rss in ranges:
        if rss and lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(_MADV_DONTNEED)) == 0:
            released += rss
    return released


def _library_mapping(head: list, names) -> tuple | None:
    """(lo, hi) of a maps / smaps header line's mapping when it is a named library's and not
    writable."""
    path = head[5] if len(head) > 5 else ""
    if "w" in head[1] or not any(n in path.rsplit("/", 1)[-1] for n in names):
        return None
    lo, hi = (int(x, 16) for x in head[0].split("-"))
    return lo, hi


_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61  # /proc/PID/pagemap entry bits


def _clean_ranges_pagemap(names) -> list:
    """[(lo, hi, resident bytes)] of the named libraries' read-only mappings with no private page
    (one resident or swapped out that is not the file's)."""
    import numpy as np

    with open("/proc/self/maps") as f:
        mappings = [
            m for m in (_library_mapping(line.rstrip("\n").split(None, 5), names) for line in f) if m is not None
        ]
    page = os.sysconf("SC_PAGE_SIZE")
    out = []
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for lo, hi in mappings:
            entries = np.frombuffer(os.pread(pagemap.fileno(), (hi - lo) // page * 8, lo // page * 8), np.uint64)
            present = (entries & np.uint64(_PRESENT)) != 0
            private = (present & ((entries & np.uint64(_FILE)) == 0)) | ((entries & np.uint64(_SWAPPED)) != 0)
            if not private.any():
                out.append((lo, hi, int(present.sum()) * page))
    return out


def _clean_ranges_smaps(names) -> list:
    """The same from /proc/self/smaps (Rss and Anonymous per mapping); [] if it cannot be read."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return []
    ranges, current = [], None
    for line in text.splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
            mapping = _library_mapping(head, names)
            current = None if mapping is None else [*mapping, 0, 0]
            if current is not None:
                ranges.append(current)
        elif current is not None and head[0] in ("Rss:", "Anonymous:"):
            current[2 if head[0] == "Rss:" else 3] = int(head[1]) << 10
    return [(lo, hi, rss) for lo, hi, rss, anon in ranges if not anon]
