"""Read a tool's model files into the page cache before its timed run, and say how much is there.

Why: a model whose GGUF (llama.cpp maps it) and kvchat's weight pack (kvchat maps that instead)
do not both fit in the page cache, e.g. a gpt-oss-20b-shaped file of 12.1 GB and its 11.5 GB pack
on a 23 GiB machine, cannot be compared by alternating runs alone: each tool's run would read
from disk whatever the other's run just evicted, and the t/s would measure the disk. So each run
is preceded by a sequential read of that tool's own files (the other's pages are then the ones
evicted), and the resident share of every file is printed (mincore), so a round that ran on a
partly evicted file is seen. Used by benchmarks/vs_llamacpp.py --page-in.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import time
from pathlib import Path

import numpy as np

CHUNK = 64 << 20  # bytes a read
_libc = ctypes.CDLL(None, use_errno=True)


def page_in(paths: list[Path]) -> tuple[int, float]:
    """Read every file from start to end once (its pages then sit in the page cache); (bytes, s)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def resident(path: Path) -> float:
    """The share of the file's pages in the page cache now (0..1): mincore on a private mapping
    (copy-on-write, never written: its pages are the file's cached pages)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    n_pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n_pages)()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            start = ctypes.c_char.from_buffer(mm)  # the mapping's first byte (writable: ACCESS_COPY)
            rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
            del start
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        finally:
            mm.close()
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) / n_pages


def kvchat_packs(model: Path, env: dict) -> list[Path]:
    """kvchat's weight pack files of `model` under the cache that env selects (runtime/weights/
    cache.py's naming: $KVCHAT_CACHE/packed/<sha256 of the file's real path, 16 hex>-<key>.kvpack)."""
    root = Path(env.get("KVCHAT_CACHE") or Path.home() / ".cache" / "kvchat") / "packed"
    stem = hashlib.sha256(os.path.realpath(model).encode()).hexdigest()[:16]
    return sorted(root.glob(f"{stem}-*.kvpack"))
