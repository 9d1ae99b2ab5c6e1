"""Memory state i/o (llama_io_* and the KV cache's state_write/state_read), in llama.cpp's layout.

Per KV cache:
  u32 n_stream
  per stream:  u32 cell_count            (0: nothing follows for this stream)
    cells:     per cell i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
    data:      u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v   (Hadamard chunk sizes, 0 = none)
               per layer: i32 type_k, u64 k_row_bytes, K rows of the cells in cell order
               V, per layer: i32 type_v, u64 v_row_bytes, rows            (flash attention on)
                         or: i32 type_v, u32 elem_bytes, u32 n_embd_v_gqa, then for each of
                             the n_embd_v_gqa V rows the elements of the cells (transposed V)

Reading is two-phase so a bad blob never changes anything: `kv_state_parse` reads and checks
everything (bounds, stream/layer counts, v_trans, types, row sizes, cell_count <= capacity,
sequence ids in range) into arrays; `kv_state_place` puts the cells in (a single sequence goes
through find_slot/apply_ubatch like a normal ubatch, and is undone if it does not fit);
`kv_state_write_data` copies the rows. Files are written atomically (`atomic_write`).
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


# ---- KV cache state ---------------------------------------------------------------------------

def _selected_cells(kv, strm: int, seq_id: int) -> np.ndarray:
    """Cells of a stream to save: all non-empty, or those of seq_id inside its SWA window."""
    cells = kv.cells[strm]
    if seq_id < 0:
        return np.flatnonzero(cells.pos >= 0)
    sel = cells.seq[:, seq_id] & (cells.pos >= 0)
    if kv.n_swa > 0:
        pmax = cells.seq_pos_max(seq_id)
        sel &= ~((pmax - cells.pos) >= kv.n_swa)
    return np.flatnonzero(sel)


def kv_state_write(kv, io: StateWriter, seq_id: int = -1) -> None:
    """Write the cells (all, or one sequence's) and their K/V rows of every stream."""
    from kernels.ggml_types import row_bytes

    if seq_id >= 0:
        kv._check_seq(seq_id)
    io.write_u32(kv.n_stream)
    for strm in range(kv.n_stream):
        if seq_id >= 0 and kv.seq_to_stream[seq_id] != strm:
            io.write_u32(0)
            continue
        cells = kv.cells[strm]
        idxs = _selected_cells(kv, strm, seq_id)
        io.write_u32(int(idxs.size))
        if idxs.size == 0:
            continue
        for i in idxs.tolist():
            seqs = [seq_id] if seq_id >= 0 else np.flatnonzero(cells.seq[i]).tolist()
            io.write_i32(int(cells.pos[i]))
            io.write_u32(len(seqs))
            for s in seqs:
                io.write_i32(int(s))
        io.write_u32(1 if kv.v_trans else 0)
        io.write_u32(len(kv.layers))
        io.write_u32(kv.n_rot_k)  # rows are stored rotated: a reader must rotate alike
        io.write_u32(kv.n_rot_v)
        for l in kv.layers:
            io.write_i32(kv.type_k)
            io.write_u64(row_bytes(kv.type_k, l.n_embd_k))
            io.write_array(l.k[strm, idxs])
        for l in kv.layers:
            io.write_i32(kv.type_v)
            if kv.v_trans:
                el = l.v.shape[2] // kv.kv_size
                io.write_u32(el)
                io.write_u32(l.n_embd_v)
                io.write_array(l.v[strm][:, kv._trans_cols(idxs)])
            else:
                io.write_u64(row_bytes(kv.type_v, l.n_embd_v))
                io.write_array(l.v[strm, idxs])


class _StreamState:
    __slots__ = ("strm", "pos", "seqs", "k", "v")

    def __init__(self, strm, pos, seqs, k, v):
        self.strm, self.pos, self.seqs, self.k, self.v = strm, pos, seqs, k, v


def kv_state_parse(kv, io: StateReader, seq_id: int = -1) -> list[_StreamState]:
    """Read and fully validate one KV cache's state; nothing in `kv` changes."""
    from kernels.ggml_types import row_bytes, type_info

    name = f"KV cache{' ' + kv.name if kv.name else ''}"
    n_stream = io.read_u32()
    if n_stream != kv.n_stream:
        raise StateError(f"{name}: n_stream mismatch ({n_stream} saved, {kv.n_stream} here)")
    out: list[_StreamState] = []
    for s in range(n_stream):
        cell_count = io.read_u32()
        if cell_count == 0:
            continue
        if cell_count > kv.kv_size:
            raise StateError(f"{name}: not enough cells ({cell_count} saved > {kv.kv_size})")
        pos = np.empty(cell_count, dtype=np.int32)
        seqs: list[list[int]] = []
        for i in range(cell_count):
            p = io.read_i32()
            n_seq = io.read_u32()
            if p < 0:
                raise StateError(f"{name}: cell {i} has negative position {p}")
            if seq_id >= 0 and n_seq != 1:
                raise StateError(f"{name}: invalid seq_id-agnostic kv cell ({n_seq} sequences)")
            if n_seq > kv.n_seq_max:
                raise StateError(f"{name}: cell {i} lists {n_seq} sequences (max {kv.n_seq_max})")
            ss = [io.read_i32() for _ in range(n_seq)]
            for x in ss:
                if not 0 <= x < kv.n_seq_max:
                    raise StateError(f"{name}: invalid seq_id, {x} is out of range "
                                     f"[0, {kv.n_seq_max})")
            if len(set(ss)) != len(ss):
                raise StateError(f"{name}: cell {i} lists a sequence twice")
            pos[i] = p
            seqs.append(ss)
        v_trans = io.read_u32()
        n_layer = io.read_u32()
        n_rot_k, n_rot_v = io.read_u32(), io.read_u32()
        if n_layer != len(kv.layers):
            raise StateError(f"{name}: mismatched layer count ({n_layer} instead of {len(kv.layers)})")
        if bool(v_trans) != kv.v_trans or v_trans > 1:
            raise StateError(f"{name}: incompatible V transposition (flash attention setting differs)")
        if (n_rot_k, n_rot_v) != (kv.n_rot_k, kv.n_rot_v):
            raise StateError(f"{name}: incompatible key/value rotation ({n_rot_k}/{n_rot_v} instead of "
                             f"{kv.n_rot_k}/{kv.n_rot_v})")
        ks, vs = [], []
        for l in kv.layers:
            t = io.read_i32()
            if t != kv.type_k:
                raise StateError(f"{name}: mismatched key type (layer {l.il}: "
                                 f"{_tname(t)} saved, {type_info(kv.type_k).name} here)")
            rb = io.read_u64()
            if rb != row_bytes(kv.type_k, l.n_embd_k):
                raise StateError(f"{name}: mismatched key row size (layer {l.il})")
            ks.append(io.read_array(rb * cell_count, (cell_count, rb)))
        for l in kv.layers:
            t = io.read_i32()
            if t != kv.type_v:
                raise StateError(f"{name}: mismatched value type (layer {l.il}: "
                                 f"{_tname(t)} saved, {type_info(kv.type_v).name} here)")
            if kv.v_trans:
                el = io.read_u32()
                if el != l.v.shape[2] // kv.kv_size:
                    raise StateError(f"{name}: mismatched value element size (layer {l.il})")
                ne = io.read_u32()
                if ne != l.n_embd_v:
                    raise StateError(f"{name}: mismatched GQA embedding size (layer {l.il})")
                vs.append(io.read_array(ne * cell_count * el, (ne, cell_count * el)))
            else:
                rb = io.read_u64()
                if rb != row_bytes(kv.type_v, l.n_embd_v):
                    raise StateError(f"{name}: mismatched value row size (layer {l.il})")
                vs.append(io.read_array(rb * cell_count, (cell_count, rb)))
        out.append(_StreamState(s, pos, seqs, ks, vs))
    if seq_id >= 0 and len(out) > 1:
        raise StateError(f"{name}: a sequence state holds cells in {len(out)} streams")
    return out


def _tname(t: int) -> str:
    from kernels.ggml_types import type_name
    return type_name(t)


def kv_state_place(kv, parsed: list[_StreamState], seq_id: int, journal: list) -> list:
    """Put parsed cells into `kv` (cells and heads only); returns [(strm, idxs)] per stream.

    Whole state (seq_id < 0): the cache is cleared and cells go to 0..n-1 of each stream.
    One sequence: its old cells are removed, then the saved ones are placed like a ubatch via
    find_slot/apply_ubatch; if they do not fit, everything is undone and StateError raised."""
    from runtime.batch import UBatch

    if seq_id < 0:
        kv.clear(True)
        placed = []
        for st in parsed:
            cells = kv.cells[st.strm]
            for i in range(st.pos.shape[0]):
                cells.pos_set(i, int(st.pos[i]))
                for s in st.seqs[i]:
                    cells.seq_add(i, s)
            kv.heads[st.strm] = 0
            placed.append((st.strm, np.arange(st.pos.shape[0], dtype=np.int64)))
        return placed

    strm = kv.seq_to_stream[seq_id]
    cells = kv.cells[strm]
    journal.append(("heads", list(kv.heads)))
    journal.append(("cells", strm, cells.cp(cells.cells_of_seq(seq_id, 0, INT_MAX))))
    kv.seq_rm(seq_id, -1, -1)
    if not parsed:
        return []
    st = parsed[0]
    n = st.pos.shape[0]
    ub = UBatch(np.full(n, -1, np.int32), st.pos.copy(), [[seq_id] for _ in range(n)],
                np.zeros(n, bool), np.arange(n, dtype=np.int32), 1, True)
    sinfo = kv.find_slot(ub)
    if sinfo is None:
        kv.undo(journal)
        raise StateError(f"failed to find {n} available cells in the KV cache for sequence {seq_id}")
    kv.apply_ubatch(sinfo, ub, journal, save_data=True)
    return [(strm, sinfo.idxs[0])]


def kv_state_write_data(kv, parsed: list[_StreamState], placed: list) -> None:
    """Copy the parsed K/V rows into the placed cells."""
    for st, (strm, idxs) in zip(parsed, placed):
        for l, k, v in zip(kv.layers, st.k, st.v):
            l.k[strm, idxs] = k
            if kv.v_trans:
                l.v[strm][:, kv._trans_cols(idxs)] = v
            else:
                l.v[strm, idxs] = v


def kv_state_apply(kv, parsed, seq_id: int) -> None:
    """Place then write (single cache). On StateError the cache is unchanged."""
    journal: list = []
    placed = kv_state_place(kv, parsed, seq_id, journal)
    kv_state_write_data(kv, parsed, placed)
