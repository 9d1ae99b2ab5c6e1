"""The byte stream of memory state i/o (llama_io_write_i / llama_io_read_i) and atomic files.

Each memory writes and parses its own part (KVCache: runtime/memory/kv_cache_state.py,
MemoryRecurrent: runtime/memory/recurrent_state.py) through these; the layouts are llama.cpp's.

Reading is two-phase everywhere (parse and check everything, then change memory), so a bad
blob never changes anything; files are written atomically (`atomic_write`).
"""

from __future__ import annotations

import os
import stat
import struct
import tempfile
import time
from typing import BinaryIO, Callable

import numpy as np

from kvchat.runtime.errors import SessionError

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
            raise StateError(
                f"state data is truncated: needed {n} bytes at offset {self.n_read}, {self.remaining()} left"
            )
        b = self._buf[self.n_read : self.n_read + n]
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


TMP_TAG = ".kvchat-tmp-"  # temp files are ".NAME.kvchat-tmp-PID-XXXXXXXX" beside NAME
STALE_LEGACY_SECONDS = 3600  # ".tmp-*" files of older kvchat versions: removed after an hour


def atomic_write(path, data: bytes | None = None, *, writer: Callable[[BinaryIO], None] | None = None) -> None:
    """Write a file so readers see the old or the new content, never half: temp file in the
    same directory, fsync, rename over the target, fsync the directory.

    The content is `data`, or whatever `writer(f)` writes to the open temp file f (binary,
    seekable: a large file written piece by piece, never held whole in memory). On any failure,
    an OSError or a KeyboardInterrupt included, the temp file is removed, the target is left as
    it was and the exception propagates.

    A symlink is written through: the temp file goes next to the link's final target and is
    renamed over it, so the link stays a link. The file keeps its mode (a new one gets the
    umask's). Temp files that a killed save left behind (their pid is gone) are removed first."""
    if (data is None) == (writer is None):
        raise TypeError("atomic_write: give either data or writer")
    path = os.path.realpath(os.fspath(path))
    d, name = os.path.split(path)
    remove_stale_temps(path)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{name}{TMP_TAG}{os.getpid()}-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if writer is None:
                f.write(data)
            else:
                writer(f)
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


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def pid_alive(pid: int) -> bool:
    """False only when no process has this pid: a temp file is removed only if its writer is gone
    (any other answer, e.g. not ours to signal, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temps(path) -> list[str]:
    """Remove temp files of saves to `path` whose writer was killed; returns their names.

    Ours are ".NAME.kvchat-tmp-PID-…": stale when PID is no longer running. Older versions wrote
    ".tmp-XXXXXXXX"; those are removed only when they start with the session magic and are over
    an hour old (nothing else of ours, or anyone's live save, looks like that)."""
    d, name = os.path.split(os.path.realpath(os.fspath(path)))
    prefix = f".{name}{TMP_TAG}"
    removed = []
    try:
        entries = os.listdir(d or ".")
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        full = os.path.join(d, entry)
        if entry.startswith(prefix):
            pid = entry[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
        elif entry.startswith(".tmp-") and len(entry) == 13:
            try:
                st = os.lstat(full)
                if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_LEGACY_SECONDS:
                    continue
                with open(full, "rb") as f:
                    if f.read(8) != b"KVCHATSS":
                        continue
            except OSError:
                continue
        else:
            continue
        try:
            os.unlink(full)
            removed.append(entry)
        except OSError:
            pass
    return removed
