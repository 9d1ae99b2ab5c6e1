"""The byte stream of memory state i/o (llama_io_write_i / llama_io_read_i) and atomic files.

Each memory writes and parses its own part (KVCache: runtime/memory/kv_cache_state.py,
MemoryRecurrent: runtime/memory/recurrent_state.py) through these; the layouts are llama.cpp's.

Reading is two-phase everywhere (parse and check everything, then change memory), so a bad
blob never changes anything; files are written atomically (`atomic_write`).
"""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np

from runtime.errors import SessionError

INT_MAX = 2**31 - 1


class StateError(SessionError):
    """A state blob that is truncated, corrupted, or belongs to another configuration."""


class StateWriter:
    """Little-endian binary writer into memory."""

    def __init__(self):
        self._parts: list[bytes] = []
        self.n_written = 0

    def write_bytes(self, b) -> None:
        b = bytes(b)
        self._parts.append(b)
        self.n_written += len(b)

    def write_u32(self, v: int) -> None:
        self.write_bytes(struct.pack("<I", v))

    def write_i32(self, v: int) -> None:
        self.write_bytes(struct.pack("<i", v))

    def write_u64(self, v: int) -> None:
        self.write_bytes(struct.pack("<Q", v))

    def write_string(self, s: str) -> None:
        b = s.encode("utf-8")
        self.write_u32(len(b))
        self.write_bytes(b)

    def write_array(self, a: np.ndarray) -> None:
        self.write_bytes(np.ascontiguousarray(a).tobytes())

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class StateReader:
    """Little-endian binary reader over a bytes object; every read is bounds-checked."""

    def __init__(self, blob: bytes):
        self._buf = memoryview(bytes(blob))
        self.n_read = 0

    def remaining(self) -> int:
        return len(self._buf) - self.n_read

    def read_bytes(self, n: int) -> memoryview:
        if n < 0 or n > self.remaining():
            raise StateError(f"state data is truncated: needed {n} bytes at offset {self.n_read}, "
                             f"{self.remaining()} left")
        b = self._buf[self.n_read:self.n_read + n]
        self.n_read += n
        return b

    def read_u32(self) -> int:
        return struct.unpack("<I", self.read_bytes(4))[0]

    def read_i32(self) -> int:
        return struct.unpack("<i", self.read_bytes(4))[0]

    def read_u64(self) -> int:
        return struct.unpack("<Q", self.read_bytes(8))[0]

    def read_string(self, max_len: int = 1 << 16) -> str:
        n = self.read_u32()
        if n > max_len:
            raise StateError(f"state string of {n} bytes is implausibly long")
        try:
            return bytes(self.read_bytes(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise StateError("state string is not valid UTF-8") from None

    def read_array(self, n_bytes: int, shape) -> np.ndarray:
        return np.frombuffer(self.read_bytes(n_bytes), dtype=np.uint8).reshape(shape)

    def expect_end(self) -> None:
        if self.remaining():
            raise StateError(f"{self.remaining()} unexpected bytes after the state data")


def atomic_write(path, data: bytes) -> None:
    """Write a file so readers see the old or the new content, never half: temp file in the
    same directory, fsync, rename over the target, fsync the directory."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
