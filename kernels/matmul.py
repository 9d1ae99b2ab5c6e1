"""y = x · Wᵀ for a weight matrix W (``QMatrix``), kept in its file's block format, for every n.

Block-quantized weights (q4_0 ... q8_0, iq4_nl, q2_K ... q6_K) run the integer kernel of
kernels/matmul_int.py: the activations are quantized per row to ggml's q8_0 / q8_1 / q8_K and
each block's dot product is an exact integer sum (VNNI where the CPU has it, kernels/cpu.py),
scaled in one fixed float order — ggml's own arithmetic. Float weights (f32 / f16 / bf16) run
the float kernel of kernels/matmul_kernels.py. Both are one kernel for every number of tokens,
so ``W.matmul(x)[t]`` is bit-identical to ``W.matmul(x[t:t+1])[0]`` whatever the batch, the
thread count and the token chunk (tests/test_matmul.py and tests/test_matmul_int.py assert it).

At load time each matrix is repacked once into a row-interleaved layout, 32 output rows side by
side (kernels/qlayout.py, kernels/repack.py), so that the SIMD lanes run over rows. Measured
choices (token chunk, work split, variants tried) are in docs/performance.md.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numba
import numpy as np

from kvchat.kernels import parallel, stand_in
from kvchat.kernels.cpu import ISA
from kvchat.kernels.ggml_types import GGMLType, row_bytes
from kvchat.kernels.matmul_int import matmul_q, matmul_q_serial
from kvchat.kernels.matmul_kernels import matmul_blocks, matmul_blocks_serial
from kvchat.kernels.qlayout import FORMATS, Packed, R, repack_int
from kvchat.kernels.quants import dequantize
from kvchat.kernels.repack import padded_k, repack

FLOAT_TYPES = (int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16))

TOKEN_CHUNK = 32  # tokens per work item: a decoded block is reused by up to this many tokens
RUNS_PER_THREAD = 4  # prange iterations per (possible) thread, each a run of consecutive work items
_RUNS = RUNS_PER_THREAD * numba.config.NUMBA_NUM_THREADS


def _mmap_root(a: np.ndarray) -> np.ndarray | None:
    """The array viewing a whole mmap (a model file's pages) that a is a view of; None when a's
    memory is a private copy."""
    b = a
    while isinstance(b, np.ndarray):
        root, b = b, b.base
    if isinstance(b, memoryview):  # np.frombuffer(mmap) views the mmap through a memoryview
        b = b.obj
    return root if isinstance(b, mmap.mmap) else None


_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20  # x86-64 PMD size: the page cache of a read-only file may be mapped in 2 MiB pages


def release_file_pages(a: np.ndarray) -> None:
    """Drop a's file pages from this process's resident set (Linux MADV_DONTNEED on a read-only
    file mapping: the data stays in the page cache and faults back in if read again). After the
    repack only get_rows reads the original rows, a few of them per token; without this the
    file's pages would stay resident next to their repacked copy.

    The range is widened to whole 2 MiB blocks (within the mapping): with transparent huge pages
    for files (khugepaged collapses a cached model file), a huge page only leaves the resident
    set when the whole of it is released, and a tensor rarely covers its pages exactly (Gemma-3
    270M kept 60 MB of file pages during load). Releasing a neighbour's pages costs at most one
    fault when it is read."""
    if not sys.platform.startswith("linux") or a.size == 0:
        return
    root = _mmap_root(a)
    if root is None:
        return
    lo, hi = root.ctypes.data, root.ctypes.data + root.nbytes
    start = max(a.ctypes.data & ~(_HUGE_PAGE - 1), lo & ~(_PAGE - 1))
    end = min((a.ctypes.data + a.nbytes + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1), hi)
    try:
        ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_DONTNEED)
        )
    except (OSError, AttributeError):  # no madvise: the pages just stay resident
        pass


def call_compiled(entries: dict, kernel, args) -> None:
    """kernel(*args) through the compiled entry point kept in entries (kernel -> entry point) for
    one caller whose argument types never change (QMatrix._call), found by the first call."""
    ep = entries.get(kernel)
    if ep is None:
        kernel(*args)
        entries[kernel] = kernel.overloads[tuple(kernel.typeof_pyval(a) for a in args)].entry_point
        return
    ep(*args)


def _format_call(t: int, min_macs: int) -> tuple:
    """(kernel, arguments) of a small matrix of ggml type t in its own format: the types of the
    call a load holding t natively makes (serial below min_macs, else parallel)."""
    from kvchat.kernels.qlayout_numpy import repack_reference

    k = 256  # one K-quant super-block, eight legacy blocks: a row of any format
    _, packed = repack_reference(np.zeros((R, row_bytes(int(t), k)), np.uint8), int(t), k)
    qm = QMatrix(None, int(t), k, packed=("int", tuple(packed)), m=R)
    return qm.kernel_call(np.zeros((1, k), np.float32), np.empty((1, R), np.float32), min_macs)


_SERIAL, _PARALLEL = 1 << 62, 0  # min_macs that pick a twin


def format_entries(t: int) -> list:
    """The compile-plan entries (kernels/compile_plan.py) of ggml type t's integer matmul: its
    serial kernel, then its parallel one — what a load holding t in its own format calls (the
    plan lists them for the next load when this one held t as another: kernels/stand_in.py)."""
    from kvchat.kernels.compile_plan import entry_of

    return [entry_of(*_format_call(t, min_macs)) for min_macs in (_SERIAL, _PARALLEL)]


def format_ready(t: int) -> bool:
    """Type t's serial integer matmul compiled in this process or held by numba's cache."""
    from kvchat.kernels.compile_plan import ready

    return ready(*_format_call(t, _SERIAL))


class QMatrix:
    """A weight matrix of m rows by k values in ggml type t, kept quantized.

    raw: u8 [m, row_bytes] (a read-only view on the model's mmap is fine: its pages are
    released from the resident set as they are repacked, and only get_rows reads rows of it
    again). packed: (kind, arrays) as ``packing()`` gives them for these rows, e.g. mapped from
    the disk cache of runtime/weights/cache.py: used as they are, so raw is never read (it may be
    None, then m gives the number of rows). Attributes: m, k, t, kind (packed layout), fmt (the
    integer kernel's QFormat, None for float weights), nbytes (bytes in the file), packed_nbytes.
    """

    def __init__(
        self,
        raw: np.ndarray | None,
        t: int,
        k: int,
        keep_raw: bool = True,
        *,
        packed: tuple[str, tuple] | None = None,
        m: int | None = None,
    ):
        self.t = int(t)
        self.k = int(k)
        rb = row_bytes(self.t, self.k)
        if raw is None:
            if packed is None or m is None:
                raise ValueError("QMatrix: without raw rows, packed arrays and m are needed")
            self.m = int(m)
        else:
            if raw.ndim != 2 or raw.dtype != np.uint8:
                raise ValueError(f"QMatrix: raw must be uint8 [m, row_bytes], got {raw.dtype} {raw.shape}")
            if raw.shape[1] != rb:
                raise ValueError(f"QMatrix: rows of {raw.shape[1]} bytes, type {GGMLType(t).name} x {k} needs {rb}")
            self.m = int(raw.shape[0])
        self.raw = raw
        self.nbytes = self.m * rb
        self._k_packed = padded_k(self.t, self.k)  # float rows are padded to whole 32-blocks
        self._k_ready = self.k if self._k_packed == self.k else -1  # x needs no padding: its width
        # a first run may hold the rows in another format with the same numbers (kernels/stand_in.py)
        held = stand_in.held_of(packed[0]) if packed is not None else stand_in.held_as(self.t)
        held = self.t if held is None else held
        self.fmt = None if self.t in FLOAT_TYPES else FORMATS.get(GGMLType(held))  # None: repack_int refuses it
        if packed is not None:
            self.kind, arrays = packed
            self._packed = tuple(arrays) if self.fmt is None else Packed(*arrays)
        elif self.fmt is None:
            self.kind, self._packed = repack(raw, t, k)
            release_file_pages(raw)
        elif held != self.t:
            self.kind = stand_in.kind_of(held)
            self.fmt, self._packed = repack_int(stand_in.as_held(raw, self.t, held), held, k)
            release_file_pages(raw)
        else:
            self.kind = "int"
            self.fmt, self._packed = repack_int(raw, t, k, done=release_file_pages)
        self.packed_nbytes = int(sum(a.nbytes for a in self._packed))
        if not keep_raw:  # e.g. a fused copy: only the repacked rows are held
            self.raw = None
        self._macs_per_token = self.m * self.k
        # the kernel's leading arguments, built once (a token calls ~100 matmuls)
        self._args = tuple(self._packed) if self.fmt is None else (ISA, self.fmt, *self._packed)
        self._entry = {}  # kernel -> its compiled entry point for this matrix (_call)

    def packing(self) -> tuple[str, tuple]:
        """(kind, packed arrays): what ``QMatrix(..., packed=...)`` takes back."""
        return self.kind, tuple(self._packed)

    def __repr__(self) -> str:
        return f"QMatrix({GGMLType(self.t).name}, m={self.m}, k={self.k})"

    def matmul(self, x: np.ndarray, min_macs: int | None = None) -> np.ndarray:
        """x f32 [n, k] -> f32 [n, m] = x @ W.T (a 1-D x [k] gives [m]). Row t of the result
        depends on row t of x only, bit for bit (module docstring), whichever twin runs: the
        parallel one from min_macs multiply-adds (parallel.MATMUL_PAR_MIN_MACS when None; a
        forward passes the threshold of its step, kernels/launch_tuner.py)."""
        if x.ndim == 1:
            return self.matmul(x[None, :], min_macs)[0]
        if not (x.dtype == np.float32 and x.flags.c_contiguous and x.shape[-1] == self._k_ready):
            x = self._prepared(x)
        n = x.shape[0]
        y = np.empty((n, self.m), np.float32)  # [n, m]
        if n:
            self._call(*self.kernel_call(x, y, min_macs))
        return y

    def kernel_call(self, x: np.ndarray, y: np.ndarray, min_macs: int | None = None) -> tuple:
        """(kernel, arguments) of y = x @ W.T for a prepared x [n, k_packed] and y [n, m]: the serial
        twin below min_macs multiply-adds (parallel.MATMUL_PAR_MIN_MACS when None), else the parallel one."""
        serial = x.shape[0] * self._macs_per_token < (parallel.MATMUL_PAR_MIN_MACS if min_macs is None else min_macs)
        if self.fmt is None:
            if serial:
                return matmul_blocks_serial, self._args + (x, y, TOKEN_CHUNK)
            return matmul_blocks, self._args + (x, y, TOKEN_CHUNK, _RUNS)
        if serial:
            return matmul_q_serial, self._args + (x, y, TOKEN_CHUNK)
        return matmul_q, self._args + (x, y, TOKEN_CHUNK, _RUNS)

    def _prepared(self, x: np.ndarray) -> np.ndarray:
        """x as the kernels take it: C-contiguous f32 [n, k_packed] (zero columns past k)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"QMatrix.matmul: x has {x.shape[-1]} columns, matrix has k={self.k}")
        if self._k_packed != self.k:
            xp = np.zeros((x.shape[0], self._k_packed), np.float32)  # [n, kp], zero columns times zero weights
            xp[:, : self.k] = x
            x = xp
        return x

    def _call(self, kernel, args) -> None:
        """kernel(*args) through the compiled entry point it has for this matrix, skipping
        numba's argument dispatch.

        A one-token decode makes ~100 small matmul calls, and the dispatcher's typing of ten
        arguments (two Python-typed: the ISA and the QFormat) took ~5 µs of each, about a small
        matmul's own work. For one matrix and kernel the argument types are fixed (its packed
        arrays, ISA and format; x a C-contiguous f32 [n, k] and y a fresh f32 [n, m], which
        matmul guarantees; ints), so the first call goes through the dispatcher (compiling or
        loading from numba's cache) and keeps the overload it chose."""
        call_compiled(self._entry, kernel, args)

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids i32 [n] -> f32 [n, k]: those rows dequantized exactly (embedding lookup)."""
        if self.raw is None:
            raise ValueError(f"{self!r}.get_rows: this matrix was loaded without its original rows")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.m):
            raise IndexError(f"QMatrix.get_rows: id out of range 0..{self.m - 1}")
        return dequantize(np.ascontiguousarray(self.raw[ids]), self.t, self.k)
