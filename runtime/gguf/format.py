"""The GGUF container's vocabulary: format constants and limits, metadata value types, the
tensor record, and the bounds-checked little-endian cursor runtime/gguf/file.py parses with
(every count and length checked against the bytes that remain before anything is allocated).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

from kvchat.kernels.ggml_types import TYPES, UNSUPPORTED_TYPES, GGMLType, TypeInfo

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_COUNT = 1 << 30  # cap on tensor / kv counts and on string and array lengths
MAX_ARRAY_DEPTH = 4  # arrays of arrays: bounded recursion
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 20
DEFAULT_ALIGNMENT = 32
INT64_MAX = (1 << 63) - 1


class GGUFValueType:
    """GGUF metadata value type ids (gguf_type)."""

    UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
    NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64")


# fixed-size value types: id -> numpy little-endian dtype
SCALAR_DTYPES = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
INT_TYPES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
# smallest encoding of one element of each type (strings: u64 length; arrays: u32 type + u64 n)
MIN_SIZE = {**{t: d.itemsize for t, d in SCALAR_DTYPES.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}

# Tokenizer arrays whose element type and length the container check enforces.
VOCAB_TOKENS = "tokenizer.ggml.tokens"
VOCAB_PARALLEL = {  # key -> accepted element types (must have one entry per token)
    "tokenizer.ggml.scores": (GGUFValueType.FLOAT32,),
    "tokenizer.ggml.token_type": (GGUFValueType.INT32,),
}
VOCAB_MERGES = "tokenizer.ggml.merges"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in ggml ne order (shape[0] = row length); `data` is a read-only
    `uint8 [n_rows, row_bytes]` view on the file's mmap (no copy)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # relative to the start of the data section
    nbytes: int
    data: np.ndarray  # [n_rows, row_bytes] u8, read-only

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_info(self) -> TypeInfo:
        return known_type(self.ggml_type)

    @property
    def supported(self) -> bool:
        """True if kernels/quants.py implements this tensor's format."""
        return int(self.ggml_type) in TYPES


def known_type(t: int) -> TypeInfo | None:
    return TYPES.get(int(t)) or UNSUPPORTED_TYPES.get(int(t))


def show_name(name: str, limit: int = 80) -> str:
    """A file-supplied name made safe for a one-line message (escaped, truncated)."""
    s = name.encode("unicode_escape", "backslashreplace").decode("ascii")
    return s if len(s) <= limit else s[:limit] + "..."


class Cursor:
    """Sequential little-endian reader over the mmap; every read is bounds-checked first."""

    def __init__(self, gf, buf: mmap.mmap, size: int):
        """gf: the GGUFFile being read (its _fail raises the one-line error)."""
        self.gf, self.buf, self.size, self.pos = gf, buf, size, 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            self.gf._fail(field, f"truncated: needs {n} bytes at offset {self.pos}, only {self.size - self.pos} left")

    def unpack(self, fmt: str, n: int, field: str):
        self.need(n, field)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def u32(self, field: str) -> int:
        return self.unpack("<I", 4, field)

    def u64(self, field: str) -> int:
        return self.unpack("<Q", 8, field)

    def count(self, field: str, min_item: int) -> int:
        """A u64 element count, checked against the cap and the bytes left."""
        n = self.u64(field)
        if n > MAX_COUNT:
            self.gf._fail(field, f"count {n} exceeds the limit {MAX_COUNT}")
        if n * min_item > self.remaining():
            self.gf._fail(
                field, f"count {n} needs at least {n * min_item} bytes, only {self.remaining()} left in the file"
            )
        return n

    def raw_string(self, field: str) -> bytes:
        n = self.count(field, 1)
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def string(self, field: str) -> str:
        b = self.raw_string(field)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            self.gf._fail(field, "string is not valid UTF-8")
