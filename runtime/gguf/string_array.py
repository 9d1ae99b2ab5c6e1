"""Many strings held as one byte blob, and a hash index from text to position.

Why: a vocabulary is 50k-262k short strings (and as many BPE merges). As Python objects —
a str each, a list, a dict of str -> int with an int object per id, a list of float scores —
Gemma-3's 262144 tokens cost ~60 MB of resident memory, a quarter of its weights. Here they
are one UTF-8 blob plus int32 offsets (~3 MB) and an open-addressing table of int32 ids
(~2 MB); a string is decoded when it is asked for.

Texts are encoded with ``surrogateescape`` (GGUF strings that are not valid UTF-8 round-trip
exactly as the reader decoded them), so ``StringArray(...)[i]`` equals the str the list held.
``StringIndex.get(text)`` returns the *last* position holding that text, as
``dict(zip(strings, range(n)))`` does for duplicated texts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from zlib import crc32

import numpy as np
from numba import njit

from kvchat.kernels.compile_plan import compiling_behind, ready

_CHUNK = 16384  # strings decoded at a time when iterating (bounds the temporary str objects)


class UnreadStrings(Sequence):
    """The length of a string array a load stepped over (GGUFFile(read_strings=False)); its
    texts were never read, so asking for one is a bug of the caller."""

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = int(n)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        raise LookupError("this GGUF file was opened without its strings (read_strings=False)")


class StringArray(Sequence):
    """A read-only sequence of n str: blob bytes, starts / ends int32 [n] (byte ranges)."""

    __slots__ = ("_blob", "_starts", "_ends", "_n")

    def __init__(self, blob: bytes, starts, ends):
        self._blob = bytes(blob)
        self._starts = array("i", np.asarray(starts, np.int32).tobytes())  # Python ints on indexing
        self._ends = array("i", np.asarray(ends, np.int32).tobytes())
        self._n = len(self._starts)

    @classmethod
    def from_strings(cls, strings) -> "StringArray":
        """From str items (encoded UTF-8 with surrogateescape), joined by NUL bytes."""
        parts = [s.encode("utf-8", "surrogateescape") for s in strings]
        lens = np.fromiter(map(len, parts), np.int64, len(parts))
        ends = np.cumsum(lens + 1) - 1  # one NUL between texts, as the GGUF reader packs them
        if ends.size and ends[-1] >= 2**31:
            raise ValueError("StringArray: more than 2 GiB of text")
        return cls(b"\0".join(parts), ends - lens, ends)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("StringArray index out of range")
        return self._blob[self._starts[i] : self._ends[i]].decode("utf-8", "surrogateescape")

    def __iter__(self):
        for start in range(0, self._n, _CHUNK):
            yield from self._decode_run(start, min(start + _CHUNK, self._n))

    def _decode_run(self, i0: int, i1: int) -> list[str]:
        """Strings i0..i1-1 as a list. When they lie in the blob one NUL byte apart with no NUL
        inside (how the GGUF reader packs a file's string array), one decode and one split make
        them all; a run of texts is decoded with surrogateescape exactly as its pieces are, since
        NUL is never part of a multi-byte sequence."""
        if i1 <= i0:
            return []
        starts = np.frombuffer(self._starts, np.int32)[i0:i1]
        ends = np.frombuffer(self._ends, np.int32)[i0:i1]
        lo, hi = int(starts[0]), int(ends[-1])
        if np.array_equal(starts[1:], ends[:-1] + 1) and self._blob.count(b"\0", lo, hi) == i1 - i0 - 1:
            return self._blob[lo:hi].decode("utf-8", "surrogateescape").split("\0")
        return [self[i] for i in range(i0, i1)]

    def byte_len(self, i: int) -> int:
        return self._ends[i] - self._starts[i]

    def has_empty(self) -> bool:
        """Whether any string is empty."""
        return bool(np.any(np.frombuffer(self._ends, np.int32) == np.frombuffer(self._starts, np.int32)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # mutable-looking sequence semantics: not hashable, like list

    def __repr__(self) -> str:
        head = ", ".join(repr(self[i]) for i in range(min(3, self._n)))
        return f"StringArray([{head}{', ...' if self._n > 3 else ''}], n={self._n})"

    @property
    def nbytes(self) -> int:
        return len(self._blob) + 8 * self._n


class StringIndex:
    """text -> position in a StringArray (the last one for a repeated text); a read-only mapping
    with get, [], in and len.

    Keyed by the CRC-32 of each text's UTF-8 bytes (zlib's, computed for the whole array in one
    compiled pass at build time): Python's str hash is salted per process, so hashing every text
    meant decoding it first — ~25 ms per 50k strings, twice per vocabulary (tokens and merges),
    paid by every start. A lookup encodes its text and compares bytes."""

    __slots__ = ("strings", "_hash", "_table", "_mask")

    def __init__(self, strings: StringArray):
        self.strings = strings
        n = len(strings)
        size = 1 << max(4, (2 * n - 1).bit_length())  # load factor <= 1/2
        args = table_args(strings, size)
        # a first run compiling in workers builds it in Python while the kernel is not compiled
        h, table = (
            _build_table_py(*args) if compiling_behind() and not ready(_build_table, args) else _build_table(*args)
        )
        self._hash = array("I", h.tobytes())
        self._table = array("i", table.tobytes())
        self._mask = size - 1

    def get(self, text: str, default=None):
        try:
            key = text.encode("utf-8", "surrogateescape")
        except (UnicodeEncodeError, AttributeError):  # not a str, or a surrogate no text can hold
            return default
        h = crc32(key)
        table, hashes, strings, mask = self._table, self._hash, self.strings, self._mask
        blob, starts, ends = strings._blob, strings._starts, strings._ends
        slot = h & mask
        while True:
            i = table[slot]
            if i < 0:
                return default
            if hashes[i] == h and blob[starts[i] : ends[i]] == key:
                return i
            slot = (slot + 1) & mask

    def __getitem__(self, text: str) -> int:
        i = self.get(text)
        if i is None:
            raise KeyError(text)
        return i

    def __contains__(self, text) -> bool:
        return isinstance(text, str) and self.get(text) is not None

    def __len__(self) -> int:
        return sum(1 for i in self._table if i >= 0)

    @property
    def nbytes(self) -> int:
        return 4 * len(self._table) + 4 * len(self._hash)


def table_args(strings: StringArray, size: int) -> tuple:
    """_build_table's arguments for these strings and table size."""
    return (
        np.frombuffer(strings._blob, np.uint8),
        np.frombuffer(strings._starts, np.int32),
        np.frombuffer(strings._ends, np.int32),
        size,
    )


def _crc32_table() -> np.ndarray:
    """The 256 entries of the reflected CRC-32 (polynomial 0xEDB88320) zlib computes."""
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, np.uint32(0xEDB88320) ^ (c >> np.uint32(1)), c >> np.uint32(1)).astype(np.uint32)
    return c


_CRC32 = _crc32_table()  # u32 [256]


@njit(cache=True)
def _build_table(blob, starts, ends, size):
    """(CRC-32 u32 [n] of each text's bytes blob[starts[i]:ends[i]], equal to zlib.crc32; the
    open-addressing table i32 [size] of positions, -1 empty, linear probing): a text met again
    (same hash and bytes) takes the later position."""
    n = starts.shape[0]
    h = np.empty(n, np.uint32)
    for i in range(n):
        c = np.uint32(0xFFFFFFFF)
        for b in range(starts[i], ends[i]):
            c = _CRC32[(c ^ blob[b]) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
        h[i] = c ^ np.uint32(0xFFFFFFFF)
    table = np.full(size, -1, np.int32)
    mask = size - 1
    for i in range(n):
        slot = np.int64(h[i]) & mask
        while True:
            j = table[slot]
            if j < 0:
                table[slot] = i
                break
            if h[j] == h[i] and ends[j] - starts[j] == ends[i] - starts[i]:
                same = True
                for b in range(ends[i] - starts[i]):
                    if blob[starts[i] + b] != blob[starts[j] + b]:
                        same = False
                        break
                if same:
                    table[slot] = i
                    break
            slot = (slot + 1) & mask
    return h, table


def _build_table_py(blob, starts, ends, size):
    """_build_table(blob, starts, ends, size), the same arrays, without numba (zlib's CRC-32 and a
    Python probe loop: ~0.4 s for 262144 texts, against ~1 s to compile the kernel)."""
    n = starts.shape[0]
    data = blob.tobytes()
    texts = [data[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
    h = np.fromiter((crc32(t) for t in texts), np.uint32, n)
    table = [-1] * size
    mask = size - 1
    hl = h.tolist()
    for i in range(n):
        slot = hl[i] & mask
        while True:
            j = table[slot]
            if j < 0 or (hl[j] == hl[i] and texts[j] == texts[i]):
                table[slot] = i
                break
            slot = (slot + 1) & mask
    return h, np.array(table, np.int32)
