"""The packed weights of a model cached on disk, so that a warm start maps them instead of repacking.

Why: loading a model repacks every quantized matrix into the row-interleaved layout of the
kernels (kernels/qlayout.py, kernels/repack.py). That pass reads the whole file and writes fresh
anonymous memory (page faults for every 4 KiB), the largest share of a warm start. The packed
bytes depend only on the file's rows, the packing code and the CPU path, so the first load writes
them to ``$KVCHAT_CACHE/packed/<model>-<key>.kvpack`` (default ~/.cache/kvchat/packed) and later
loads map that file: copy-on-write pages that are never written, so they are the page cache's
own pages, shared by every kvchat process and held once; the GGUF's pages of packed tensors are
never touched (get_rows reads the embedding rows it needs).

``key``: a digest of this file format, kvchat.kernels.qlayout.LAYOUT_VERSION, the source of the packing
modules, the integer kernel path (kvchat.kernels.cpu.ISA), numpy's version and the byte order, and each
model part's real path, size and mtime_ns. Any change gives another key: the file is rebuilt.

File: magic (8 bytes), u64 length of the JSON table, its sha256 (32 bytes), the table (key, model
paths, bytes of array data; per tensor: ggml type, k, m, kind and each array's dtype, shape and
offset in the data), then the data, 64-byte aligned, each array 64-byte aligned. A file whose magic, table digest,
key, size or any array extent
does not check out is not used (and is rebuilt by this load); the arrays' bytes themselves are
not re-hashed at load (that would read them all, the cost this cache removes).

Writes go through kvchat.runtime.memory.state.atomic_write (a temporary file in the same directory,
fsync, rename; the temp removed on any failure); an OS error (a read-only directory, a full
disk) only logs at debug level and the load keeps its in-memory pack.
Writing a pack removes the model's packs under older keys, packs of model files that no longer
exist and temporaries of dead processes, so the directory stays bounded.
``KVCHAT_WEIGHT_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvchat.runtime.memory.state import TMP_TAG, atomic_write, pid_alive

log = logging.getLogger(__name__)

MAGIC = b"KVPACK\x00\x01"
FORMAT_VERSION = 1
SUFFIX = ".kvpack"
_ALIGN = 64
_PREFIX = len(MAGIC) + 8 + 32  # magic, table length, table sha256
_MAX_TABLE = 64 << 20
_PACK_MODULES = ("kvchat.kernels.qlayout", "kvchat.kernels.qlayout_pack", "kvchat.kernels.repack")
_MADV_POPULATE_READ = 22  # Linux 5.14+: map every page of the range (no copy), one call instead of a fault a page
_STALE_TMP_S = 24 * 3600


def packs_dir() -> Path:
    """$KVCHAT_CACHE/packed (kvchat.cli.sources.paths.cache_dir's rule, default ~/.cache/kvchat; the runtime
    does not import cli)."""
    return Path(os.environ.get("KVCHAT_CACHE") or Path.home() / ".cache" / "kvchat") / "packed"


def cache_dir() -> Path | None:
    """packs_dir(), or None when KVCHAT_WEIGHT_CACHE is 0 / off / no / false."""
    if os.environ.get("KVCHAT_WEIGHT_CACHE", "").strip().lower() in ("0", "off", "no", "false"):
        return None
    return packs_dir()


def _model_files(gf) -> list[str]:
    return [os.path.realpath(p) for p in getattr(gf, "part_paths", None) or [gf.path]]


def _code_digest(modules=_PACK_MODULES) -> str:
    h = hashlib.sha256()
    for name in modules:
        origin = importlib.util.find_spec(name).origin
        with open(origin, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def pack_key(files: list[str], variant: str = "", code: tuple = ()) -> str:
    """The key of the packs of these model files on this machine (module docstring); variant and
    the source of the modules in code for packs derived from the file's rows (a self-draft's copy)."""
    from kvchat.kernels.cpu import ISA
    from kvchat.kernels.qlayout import LAYOUT_VERSION

    parts = []
    for p in files:
        st = os.stat(p)
        parts.append([p, st.st_size, st.st_mtime_ns])
    what = {
        "format": FORMAT_VERSION,
        "layout": LAYOUT_VERSION,
        "code": _code_digest(),
        "isa": ISA.name,
        "numpy": np.__version__,
        "byteorder": sys.byteorder,
        "files": parts,
    }
    if variant:
        what["variant"] = [variant, _code_digest(code)]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _stem(first_file: str) -> str:
    return hashlib.sha256(first_file.encode()).hexdigest()[:16]


def _read_table(f, size: int) -> dict | None:
    """The JSON table of an open pack file if its prefix checks out and the file holds exactly
    its arrays (`base`: where they start), else None."""
    head = f.read(_PREFIX)
    if len(head) != _PREFIX or head[:8] != MAGIC:
        return None
    n = int.from_bytes(head[8:16], "little")
    if n > min(_MAX_TABLE, size - _PREFIX):
        return None
    raw = f.read(n)
    if len(raw) != n or hashlib.sha256(raw).digest() != head[16:48]:
        return None
    try:
        table = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(table, dict) or table.get("data", -1) != size - _data_start(n):
        return None
    table["base"] = _data_start(n)
    return table


class PackStore:
    """The packs of one model for one load: ``get`` hands out mapped arrays of a valid cache file,
    ``put`` records every matrix's packing, ``save`` writes the file when anything was missing."""

    def __init__(self, directory: Path, files: list[str], variant: str = "", code: tuple = ()):
        self.directory = Path(directory)
        self.files = files
        self.key = pack_key(files, variant, code)
        stem = _stem(files[0] + (f"#{variant}" if variant else ""))  # a variant's packs live beside the model's
        self.path = self.directory / f"{stem}-{self.key[:24]}{SUFFIX}"
        self._entries: dict = {}
        self._mm = None
        self._base = 0
        self._recorded: dict = {}
        self.hits = 0
        self.missed = False
        self._open()

    # ---- reading ----------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                table = _read_table(f, size)
                if table is None or table.get("key") != self.key:
                    log.debug("weight cache: %s is not a valid pack for this model; rebuilding", self.path)
                    return
                entries = self._checked(table.get("tensors"), table["data"])
                if entries is None:
                    log.debug("weight cache: %s has a bad tensor table; rebuilding", self.path)
                    return
                # copy-on-write: writable arrays (the kernels' compiled signatures) on the page cache's pages
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            if not isinstance(e, FileNotFoundError):
                log.debug("weight cache: cannot read %s: %s", self.path, e)
            return
        _populate(mm)
        self._mm, self._entries, self._base = mm, entries, table["base"]

    @staticmethod
    def _checked(tensors, data: int) -> dict | None:
        if not isinstance(tensors, dict):
            return None
        try:
            for e in tensors.values():
                if not (isinstance(e["kind"], str) and all(isinstance(e[f], int) for f in ("t", "k", "m"))):
                    return None
                for dt, shape, off in e["arrays"]:
                    if np.dtype(dt).kind not in "iuf" or min(shape, default=0) < 0:
                        return None
                    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                    if off % _ALIGN or off < 0 or off + n > data:
                        return None
        except (KeyError, TypeError, ValueError):
            return None
        return tensors

    def get(self, name: str, t: int, k: int, m: int) -> tuple[str, tuple] | None:
        """(kind, arrays) of the cached packing of tensor `name` ([m, k] of ggml type t), or None
        (then the caller packs it and the file is rewritten by save)."""
        e = self._entries.get(name)
        if e is None or (e["t"], e["k"], e["m"]) != (t, k, m):
            self.missed = True
            return None
        arrays = []
        for dt, shape, off in e["arrays"]:
            dtype = np.dtype(dt)
            count = int(np.prod(shape, dtype=np.int64))
            a = np.frombuffer(self._mm, dtype, count, self._base + off) if count else np.zeros(0, dtype)
            arrays.append(a.reshape(shape))
        self.hits += 1
        return e["kind"], tuple(arrays)

    def put(self, name: str, t: int, k: int, m: int, packing: tuple[str, tuple]) -> None:
        self._recorded[name] = (t, k, m, packing)

    # ---- writing ----------------------------------------------------------------------------
    def save(self) -> None:
        """Write the pack file if this load repacked anything; never raises for an OS error."""
        if not self.missed and self._entries:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, writer=self._write)  # removes its temp on any failure, Ctrl-C too
        except OSError as e:
            log.debug("weight cache: cannot write %s: %s", self.path, e)
            return
        sweep(self.directory, keep=self.path)

    def _write(self, f) -> None:
        """The pack into the open (seekable, binary) file f: prefix, table, then each array at its offset."""
        tensors, order, off = {}, [], 0
        for name, (t, k, m, (kind, arrays)) in self._recorded.items():
            specs = []
            for a in arrays:
                off = -(-off // _ALIGN) * _ALIGN
                specs.append([a.dtype.str, list(a.shape), off])
                order.append((off, a))
                off += a.nbytes
            tensors[name] = {"t": t, "k": k, "m": m, "kind": kind, "arrays": specs}
        raw = _dump({"key": self.key, "files": self.files, "data": off, "tensors": tensors})
        base = _data_start(len(raw))
        f.write(MAGIC + len(raw).to_bytes(8, "little") + hashlib.sha256(raw).digest() + raw)
        for o, a in order:
            f.seek(base + o)
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        f.truncate(base + off)


def _data_start(table_len: int) -> int:
    """Where the arrays start: after the prefix and the table, 64-byte aligned (offsets are relative to it)."""
    return -(-(_PREFIX + table_len) // _ALIGN) * _ALIGN


def _dump(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _unlink(p: Path) -> int:
    try:
        n = p.stat().st_size
        p.unlink()
        return n
    except OSError:
        return 0


def _populate(mm: mmap.mmap) -> None:
    """Map the whole file at once (Linux MADV_POPULATE_READ; elsewhere pages fault in as read)."""
    if hasattr(mm, "madvise"):
        try:
            mm.madvise(_MADV_POPULATE_READ)
        except OSError:
            pass


def _temp_pid(name: str) -> int | None:
    """The writer's pid of a temporary pack (atomic_write's ".NAME.kvchat-tmp-PID-XXXX"; session 7
    wrote ".NAME.PID.tmp"), -1 if it names none, None for any other file."""
    if not name.startswith("."):
        return None
    if TMP_TAG in name:
        pid = name.split(TMP_TAG, 1)[1].split("-", 1)[0]
    elif name.endswith(".tmp"):
        pid = name.rsplit(".", 2)[-2]
    else:
        return None
    return int(pid) if pid.isdigit() else -1


def sweep(directory: Path | None = None, keep: Path | None = None) -> int:
    """Remove packs of model files that no longer exist (or changed: another key for the same
    model), and temporaries of writers that died; bytes freed. Never raises for an OS error."""
    directory = packs_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        return 0
    freed = 0
    keep_stem = keep.name.split("-", 1)[0] if keep is not None else None
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        p = directory / name
        pid = _temp_pid(name)
        if pid is not None:
            try:
                old = time.time() - p.stat().st_mtime > _STALE_TMP_S
            except OSError:
                continue
            if pid != os.getpid() and (old or not pid_alive(pid)):
                freed += _unlink(p)
            continue
        if not name.endswith(SUFFIX) or (keep is not None and p == keep):
            continue
        if keep_stem is not None and name.split("-", 1)[0] == keep_stem:
            freed += _unlink(p)  # the same model under an older key
            continue
        try:
            with open(p, "rb") as f:
                table = _read_table(f, os.fstat(f.fileno()).st_size)
        except OSError:
            continue
        files = table.get("files") if table else None
        if not files or not all(os.path.exists(x) for x in files):
            freed += _unlink(p)
    return freed


def open_store(gf, variant: str = "", code: tuple = ()) -> PackStore | None:
    """The pack store of an open GGUF model (or of a variant of its weights made by the modules
    in code, e.g. "self:q4_0"), or None when the cache is off or unusable."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        return PackStore(directory, _model_files(gf), variant, code)
    except (OSError, ValueError) as e:
        log.debug("weight cache: off for %s: %s", gf.path, e)
        return None
