"""Bounded, validated reading of a GGUF file; tensors are read-only views on one mmap.

Why not `gguf.GGUFReader`: it trusts the file. A 4 MB file claiming a 2^40-element array makes
it allocate for ~40 s, string lengths past the end are silently truncated, and overlapping or
misaligned tensors are accepted. Here every count and length is checked against the bytes that
remain (and a hard cap) *before* anything is allocated or looped over, so a hostile or truncated
file fails in microseconds with a one-line ModelFileError naming the file, the field and the
problem.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment | tensor data (offsets relative to this point)

This module checks the *container* (structure, types, bounds, alignment, overlaps, tokenizer
array shapes). Whether the metadata describes a model we can run (required keys, head counts,
tensor shapes) is checked by kvchat.runtime.arch.read_hparams, so `kvchat info` can still
describe a well-formed file of an architecture we do not support.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.kernels.compile_plan import compiling_behind, ready
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.gguf_strings import scan_strings, scan_strings_py, string_lengths
from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.format import (
    DEFAULT_ALIGNMENT,
    FLOAT_TYPES,
    GGUF_MAGIC,
    INT64_MAX,
    INT_TYPES,
    MAX_ALIGNMENT,
    MAX_ARRAY_DEPTH,
    MAX_DIMS,
    MIN_SIZE,
    SCALAR_DTYPES,
    SUPPORTED_VERSIONS,
    VOCAB_MERGES,
    VOCAB_PARALLEL,
    VOCAB_TOKENS,
    Cursor,
    GGUFValueType,
    TensorInfo,
    known_type,
    show_name,
)
from kvchat.runtime.gguf.string_array import StringArray, UnreadStrings

__all__ = ["GGUFFile", "TensorInfo", "ModelFileError", "GGUFValueType"]


class GGUFFile:
    """A parsed, validated GGUF file.

    `metadata` values: int / float / bool / str; arrays of strings as a read-only sequence of str
    (kvchat.runtime.gguf.string_array.StringArray; invalid UTF-8 bytes kept via surrogateescape), numeric arrays as
    numpy arrays (copied, native order),
    arrays of arrays as lists. `value_types[key]` is (type, element type or None).
    `raw` is the whole file as a read-only u8 array; every tensor's `data` is a slice of it.
    Tensors share one read-only mmap; `close()` drops our reference — the mapping itself stays
    until the last view (e.g. held by model weights) is gone.
    """

    def __init__(self, path: str | os.PathLike, *, split_part: bool = False, read_strings: bool = True):
        """`split_part`: a second or later file of a split model (llama.cpp's gguf-split), which
        holds only the split.* keys and its share of the tensors, so no general.architecture.
        `read_strings=False`: string arrays (the vocabulary) are only stepped over and held as
        UnreadStrings (their length): a compile plan's load needs no token text, and reading
        it compiles the vocabulary's kernels (~1.7 s CPU, runtime/startup/compile_worker.py)."""
        self.path = Path(path)
        self._split_part = split_part
        self._read_strings = read_strings
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[int, int | None]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._mm: mmap.mmap | None = None
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size < 24:
                    self._fail("header", f"truncated: file is {self.file_size} bytes, a GGUF header needs 24")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open: {e.strerror or e}") from None
        self._parse()

    # ----------------------------------------------------------------- public API
    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        """Forget the mapping (unmapped now if no tensor view is alive, else when the last goes)."""
        mm, self._mm = self._mm, None
        self.tensors = {}
        self.raw = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported; the OS mapping lives until they are collected

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fail(self, field: str, problem: str):
        """Raise the one-line ModelFileError for `field` of this file (used by hparams too)."""
        self._fail(field, problem)

    def _fail(self, field: str, problem: str):
        raise ModelFileError(f"{self.path}: {show_name(field)}: {problem}")

    # ----------------------------------------------------------------- parsing
    def _parse(self) -> None:
        cur = Cursor(self, self._mm, self.file_size)
        magic = bytes(self._mm[0:4])
        if magic != GGUF_MAGIC:
            self._fail("magic", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (big-endian GGUF is not supported)" if swapped in SUPPORTED_VERSIONS else ""
            self._fail("version", f"unsupported GGUF version {version}{hint}; supported: 2, 3")
        self.version = version
        n_tensors = cur.count("tensor_count", 8 + 4 + 8 + 4 + 8)  # name len, n_dims, ne, type, offset
        n_kv = cur.count("kv_count", 8 + 4 + 1)  # key len, type, smallest value

        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                self._fail(key, "duplicate metadata key")
            vtype = cur.u32(f"{key} (type)")
            self.metadata[key], self.value_types[key] = self._read_value(cur, key, vtype, 0)

        self.alignment = self._alignment()
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        align = self.alignment
        self.data_offset = (cur.pos + align - 1) // align * align
        self._place_tensors(infos)
        self._check_metadata()

    def _read_value(self, cur: Cursor, key: str, vtype: int, depth: int):
        if vtype in SCALAR_DTYPES:
            dt = SCALAR_DTYPES[vtype]
            cur.need(dt.itemsize, key)
            v = np.frombuffer(self._mm, dtype=dt, count=1, offset=cur.pos)[0].item()
            cur.pos += dt.itemsize
            if vtype == GGUFValueType.BOOL:
                if v > 1:
                    self._fail(key, f"bool value {v} is neither 0 nor 1")
                v = bool(v)
            return v, (vtype, None)
        if vtype == GGUFValueType.STRING:
            return cur.string(key), (vtype, None)
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self._fail(key, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
            etype = cur.u32(f"{key} (array type)")
            if etype not in MIN_SIZE:
                self._fail(key, f"invalid array element type {etype}")
            n = cur.count(f"{key} (array length)", MIN_SIZE[etype])
            return self._read_array(cur, key, etype, n, depth), (vtype, etype)
        self._fail(key, f"invalid value type {vtype}")

    def _read_array(self, cur: Cursor, key: str, etype: int, n: int, depth: int):
        if etype in SCALAR_DTYPES:
            dt = SCALAR_DTYPES[etype]
            # count() already checked n * itemsize against the bytes left
            a = np.frombuffer(self._mm, dtype=dt, count=n, offset=cur.pos)
            cur.pos += n * dt.itemsize
            if etype == GGUFValueType.BOOL:
                if n and int(a.max()) > 1:
                    self._fail(key, "bool array holds a value other than 0 or 1")
                return a.astype(bool)
            return a.astype(dt.newbyteorder("="), copy=True)
        if etype == GGUFValueType.STRING:
            return self._read_string_array(cur, key, n)
        return [self._read_value(cur, f"{key}[{i}]", etype, depth + 1)[0] for i in range(n)]

    def _read_string_array(self, cur: Cursor, key: str, n: int):
        """n strings without a Python loop: a numba pass walks the length prefixes (bounds-
        checked) and packs the texts into one blob, held as a StringArray (runtime/gguf/string_array.py:
        a str is decoded when read, so a 262144-token vocabulary costs ~4 MB, not ~25 MB of
        Python objects)."""
        if n == 0:
            return []
        if not self._read_strings:
            return self._step_over_strings(cur, key, n)
        arr = np.frombuffer(self._mm, dtype=np.uint8)
        args = (arr, cur.pos, n)
        # a first run compiling in workers walks them in Python while the kernel is not compiled
        scan = scan_strings_py if compiling_behind() and not ready(scan_strings, args) else scan_strings
        packed, bounds, end, bad, has_nul = scan(*args)
        if bad >= 0:
            self._fail(f"{key}[{bad}]", f"string runs past the end of the file (at offset {end})")
        cur.pos = end
        if packed.size >= 2**31:
            blob = packed.tobytes()
            return [blob[bounds[i, 0] : bounds[i, 1]].decode("utf-8", "surrogateescape") for i in range(n)]
        return StringArray(packed.tobytes(), bounds[:, 0], bounds[:, 1])

    def _step_over_strings(self, cur: Cursor, key: str, n: int) -> "UnreadStrings":
        """Past n strings by their length prefixes (bounds-checked as scan_strings does), unread."""
        _, end, bad = string_lengths(np.frombuffer(self._mm, dtype=np.uint8), cur.pos, n)
        if bad >= 0:
            self._fail(f"{key}[{bad}]", f"string runs past the end of the file (at offset {end})")
        cur.pos = end
        return UnreadStrings(n)

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        a = self.metadata["general.alignment"]
        if self.value_types["general.alignment"][0] not in INT_TYPES:
            self._fail("general.alignment", "must be an integer")
        if a <= 0 or a & (a - 1) or a > MAX_ALIGNMENT:
            self._fail("general.alignment", f"{a} is not a power of two between 1 and {MAX_ALIGNMENT}")
        return a

    def _read_tensor_info(self, cur: Cursor, i: int):
        name = cur.string(f"tensor #{i} (name)")
        n_dims = cur.u32(f"tensor {name} (n_dims)")
        if not 1 <= n_dims <= MAX_DIMS:
            self._fail(f"tensor {name}", f"n_dims {n_dims} not in 1..{MAX_DIMS}")
        shape = tuple(cur.u64(f"tensor {name} (dims)") for _ in range(n_dims))
        n = 1
        for d in shape:
            if d == 0:
                self._fail(f"tensor {name}", f"dimension of size 0 in shape {list(shape)}")
            if d > INT64_MAX // n:
                self._fail(f"tensor {name}", f"element count of shape {list(shape)} overflows int64")
            n *= d
        t = cur.u32(f"tensor {name} (type)")
        info = known_type(t)
        if info is None:
            self._fail(f"tensor {name}", f"unknown ggml type id {t}")
        if shape[0] % info.block_size:
            self._fail(
                f"tensor {name}",
                f"row length {shape[0]} is not a multiple of the {info.name} block size {info.block_size}",
            )
        offset = cur.u64(f"tensor {name} (offset)")
        nbytes = n // info.block_size * info.type_size
        return name, shape, t, info, offset, nbytes

    def _place_tensors(self, infos) -> None:
        data_size = self.file_size - self.data_offset
        # the whole file as u8, read-only (the mmap is ACCESS_READ); every tensor is a slice of it
        self.raw = arr = np.frombuffer(self._mm, dtype=np.uint8)
        for name, shape, t, info, offset, nbytes in infos:
            if name in self.tensors:
                self._fail(f"tensor {name}", "duplicate tensor name")
            if offset % self.alignment:
                self._fail(
                    f"tensor {name}", f"data offset {offset} is not a multiple of the alignment {self.alignment}"
                )
            if offset > data_size or nbytes > data_size - offset:
                self._fail(
                    f"tensor {name}",
                    f"data [{offset}, {offset + nbytes}) lies outside the data section ({max(data_size, 0)} bytes)",
                )
            row = shape[0] // info.block_size * info.type_size
            start = self.data_offset + offset
            view = arr[start : start + nbytes].reshape(nbytes // row, row)
            self.tensors[name] = TensorInfo(name, shape, _as_ggml_type(t), offset, nbytes, view)
        prev = None
        for ti in sorted(self.tensors.values(), key=lambda x: x.offset):
            if prev is not None and ti.offset < prev.offset + prev.nbytes:
                self._fail(
                    f"tensor {ti.name}",
                    f"data at offset {ti.offset} overlaps tensor {show_name(prev.name)} "
                    f"[{prev.offset}, {prev.offset + prev.nbytes})",
                )
            prev = ti

    def _check_metadata(self) -> None:
        """Container-level metadata rules: architecture name, tokenizer array types/lengths."""
        if "general.architecture" not in self.metadata:
            if self._split_part:
                return
            self._fail("general.architecture", "missing (required)")
        if self.value_types["general.architecture"][0] != GGUFValueType.STRING or not self.arch:
            self._fail("general.architecture", "must be a non-empty string")
        if VOCAB_TOKENS in self.metadata:
            self._expect_array(VOCAB_TOKENS, (GGUFValueType.STRING,))
            n_vocab = len(self.metadata[VOCAB_TOKENS])
            if n_vocab == 0:
                self._fail(VOCAB_TOKENS, "empty vocabulary")
            for key, etypes in VOCAB_PARALLEL.items():
                if key in self.metadata:
                    self._expect_array(key, etypes)
                    if len(self.metadata[key]) != n_vocab:
                        self._fail(key, f"has {len(self.metadata[key])} entries, {VOCAB_TOKENS} has {n_vocab}")
        if VOCAB_MERGES in self.metadata:
            self._expect_array(VOCAB_MERGES, (GGUFValueType.STRING,))

    def _expect_array(self, key: str, etypes: tuple[int, ...]) -> None:
        vt, et = self.value_types[key]
        if vt != GGUFValueType.ARRAY or et not in etypes:
            got = GGUFValueType.NAMES[vt] + (f" of {GGUFValueType.NAMES[et]}" if et is not None else "")
            want = " or ".join(GGUFValueType.NAMES[e] for e in etypes)
            self._fail(key, f"must be an array of {want}, got {got}")

    # ----------------------------------------------------------------- typed metadata helpers
    def get_int(self, key: str, default: Any = ..., *, min_value: int | None = None) -> int:
        """An integer metadata value; ModelFileError if missing (no default) or of another type."""
        if key not in self.metadata:
            if default is ...:
                self._fail(key, "missing (required)")
            return default
        if self.value_types[key][0] not in INT_TYPES:
            self._fail(key, f"must be an integer, got {GGUFValueType.NAMES[self.value_types[key][0]]}")
        v = self.metadata[key]
        if min_value is not None and v < min_value:
            self._fail(key, f"{v} is below the minimum {min_value}")
        return v

    def get_float(self, key: str, default: Any = ...) -> float:
        """A numeric metadata value as float (ints accepted); must be finite."""
        if key not in self.metadata:
            if default is ...:
                self._fail(key, "missing (required)")
            return default
        vt = self.value_types[key][0]
        if vt not in FLOAT_TYPES and vt not in INT_TYPES:
            self._fail(key, f"must be a number, got {GGUFValueType.NAMES[vt]}")
        v = float(self.metadata[key])
        if not np.isfinite(v):
            self._fail(key, f"{v} is not finite")
        return v

    def get_str(self, key: str, default: Any = ...) -> str:
        if key not in self.metadata:
            if default is ...:
                self._fail(key, "missing (required)")
            return default
        if self.value_types[key][0] != GGUFValueType.STRING:
            self._fail(key, f"must be a string, got {GGUFValueType.NAMES[self.value_types[key][0]]}")
        return self.metadata[key]

    def get_bool(self, key: str, default: Any = ...) -> bool:
        if key not in self.metadata:
            if default is ...:
                self._fail(key, "missing (required)")
            return default
        if self.value_types[key][0] != GGUFValueType.BOOL:
            self._fail(key, f"must be a bool, got {GGUFValueType.NAMES[self.value_types[key][0]]}")
        return self.metadata[key]


def _as_ggml_type(t: int):
    try:
        return GGMLType(t)
    except ValueError:  # a type ggml_types knows by size but not by enum member
        return t
