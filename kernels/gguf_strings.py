"""GGUF string arrays walked without a Python loop (runtime/gguf/file.py reads a vocabulary of
262144 tokens this way in ~0.05 s): the length prefixes are bounds-checked and the texts packed
into one buffer. `scan_strings_py` gives the same result with a Python walk and numpy (~0.3 s for
262144 tokens), for a first run whose kernels compile in workers (kernels/compile_plan.compiling_behind):
there it costs less than compiling `scan_strings` (~1.5 s CPU with numba's first-compile set-up)."""

import numpy as np
from numba import njit


@njit(cache=True)
def scan_strings(buf, pos, n):
    """Walk n GGUF strings (u64 length + bytes) from `pos` in `buf` (u8[:]).

    Returns (packed u8: the texts joined by single NUL bytes, bounds i64 [n, 2]: each text's
    [start, end) in packed, end position in buf, index of the first string that runs past
    the end or -1, whether any text contains a NUL byte)."""
    size = buf.shape[0]
    bounds = np.empty((n, 2), dtype=np.int64)
    # first pass: lengths and bounds only
    p = pos
    total = 0
    for i in range(n):
        if p + 8 > size:
            return np.empty(0, np.uint8), bounds, p, i, False
        ln = 0
        for b in range(8):
            ln |= np.int64(buf[p + b]) << (8 * b)
        p += 8
        if ln < 0 or ln > size - p:
            return np.empty(0, np.uint8), bounds, p, i, False
        bounds[i, 0] = total
        total += ln
        bounds[i, 1] = total
        total += 1  # separator
        p += ln
    packed = np.zeros(max(total - 1, 0), dtype=np.uint8)
    has_nul = False
    q = pos
    for i in range(n):
        q += 8
        s = bounds[i, 0]
        ln = bounds[i, 1] - s
        for j in range(ln):
            c = buf[q + j]
            if c == 0:
                has_nul = True
            packed[s + j] = c
        q += ln
    return packed, bounds, p, -1, has_nul


def string_lengths(buf, pos, n):
    """The first pass of scan_strings in Python: (lengths i64 [n], end position in buf, index of
    the first string that runs past the end or -1; at that index the position its check stopped
    at, as scan_strings returns it)."""
    size = buf.shape[0]
    mv = memoryview(buf)
    lens = np.empty(n, np.int64)
    p = pos
    for i in range(n):
        if p + 8 > size:
            return lens, p, i
        ln = int.from_bytes(mv[p : p + 8], "little")
        p += 8
        if ln >= 1 << 63 or ln > size - p:
            return lens, p, i
        lens[i] = ln
        p += ln
    return lens, p, -1


def scan_strings_py(buf, pos, n):
    """scan_strings(buf, pos, n), the same arrays and values, without numba."""
    lens, p, bad = string_lengths(buf, pos, n)
    if bad >= 0:
        return np.empty(0, np.uint8), np.empty((n, 2), np.int64), p, bad, False
    bounds = np.empty((n, 2), np.int64)
    bounds[:, 1] = np.cumsum(lens + 1) - 1  # texts joined by one separator byte
    bounds[:, 0] = bounds[:, 1] - lens
    src = pos + 8 * np.arange(1, n + 1, dtype=np.int64) + np.cumsum(lens) - lens  # where each text starts in buf
    total = int(bounds[-1, 1]) if n else 0
    packed = np.zeros(total, np.uint8)
    text = np.repeat(bounds[:, 0] - src, lens)  # dst - src, per text byte
    dst = np.arange(lens.sum(), dtype=np.int64) + np.repeat(np.arange(n, dtype=np.int64), lens)  # skip separators
    packed[dst] = buf[dst - text]
    has_nul = bool(dst.size) and not packed[dst].all()
    return packed, bounds, p, -1, has_nul
