"""Quantize / dequantize rows of every supported ggml block format.

The per-format njit row functions live in quants_fp (f32, f16, bf16), quants_legacy (32-value
blocks) and quants_k (k-quants); they are re-exported here under their contract names
``dequant_row_<fmt>(src u8[:], dst f32[:])`` / ``quant_row_<fmt>(src f32[:], dst u8[:])``.

``QUANT_TABLE`` has one entry per format (like gguf-py's type traits). Kernels do not take the
row functions as arguments (a numba function that takes another jitted function as an argument
is recompiled in every process: its cache entry is not reused); they take the type id:
- as a ``TypeArg`` (``type_arg(t)``): numba types it as the literal ``Literal[int](t)``, so
  ``dequant_row_of`` / ``quant_row_of`` pick that format's row function while the kernel is
  typed and only it is compiled — a kernel is compiled once per format a run uses, not with the
  code of all sixteen (a first run compiled ~30 row functions of formats no model of it held);
- as a plain integer: the if-chains ``dequant_row_any`` / ``quant_row_any`` (every format
  compiled into one version), kept for callers that need one compiled version for all types.
Both give the same bytes: the same row function runs.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import parallel
from .ggml_types import GGMLType, row_bytes, type_info
from .quants_fp import (  # noqa: F401  (re-exported)
    bf16_to_f32,
    dequant_row_bf16,
    dequant_row_f16,
    dequant_row_f32,
    f16_to_f32,
    f32_to_bf16,
    f32_to_f16,
    quant_row_bf16,
    quant_row_f16,
    quant_row_f32,
)
from .quants_k import (  # noqa: F401
    dequant_row_q2_K,
    dequant_row_q3_K,
    dequant_row_q4_K,
    dequant_row_q5_K,
    dequant_row_q6_K,
    dequant_row_q8_K,
)
from .quants_legacy import (  # noqa: F401
    KVALUES_IQ4NL,
    dequant_row_iq4_nl,
    dequant_row_mxfp4,
    dequant_row_q4_0,
    dequant_row_q4_1,
    dequant_row_q5_0,
    dequant_row_q5_1,
    dequant_row_q8_0,
    dequant_row_q8_1,
    quant_row_iq4_nl,
    quant_row_q4_0,
    quant_row_q4_1,
    quant_row_q5_0,
    quant_row_q5_1,
    quant_row_q8_0,
    quant_row_q8_1,
)


class QuantFuncs(NamedTuple):
    dequant_row: Callable  # njit (src u8[row_bytes], dst f32[n])
    quant_row: Optional[Callable]  # njit (src f32[n], dst u8[row_bytes]); None: decode only


T = GGMLType
QUANT_TABLE: dict[int, QuantFuncs] = {
    T.F32: QuantFuncs(dequant_row_f32, quant_row_f32),
    T.F16: QuantFuncs(dequant_row_f16, quant_row_f16),
    T.BF16: QuantFuncs(dequant_row_bf16, quant_row_bf16),
    T.Q4_0: QuantFuncs(dequant_row_q4_0, quant_row_q4_0),
    T.Q4_1: QuantFuncs(dequant_row_q4_1, quant_row_q4_1),
    T.Q5_0: QuantFuncs(dequant_row_q5_0, quant_row_q5_0),
    T.Q5_1: QuantFuncs(dequant_row_q5_1, quant_row_q5_1),
    T.Q8_0: QuantFuncs(dequant_row_q8_0, quant_row_q8_0),
    T.Q8_1: QuantFuncs(dequant_row_q8_1, quant_row_q8_1),
    T.IQ4_NL: QuantFuncs(dequant_row_iq4_nl, quant_row_iq4_nl),
    T.MXFP4: QuantFuncs(dequant_row_mxfp4, None),  # weights only; not in the run-time if-chains below
    T.Q2_K: QuantFuncs(dequant_row_q2_K, None),
    T.Q3_K: QuantFuncs(dequant_row_q3_K, None),
    T.Q4_K: QuantFuncs(dequant_row_q4_K, None),
    T.Q5_K: QuantFuncs(dequant_row_q5_K, None),
    T.Q6_K: QuantFuncs(dequant_row_q6_K, None),
    T.Q8_K: QuantFuncs(dequant_row_q8_K, None),
}

# plain ints for the njit if-chains (numba sees them as compile-time constants)
_F32, _F16, _BF16 = int(T.F32), int(T.F16), int(T.BF16)
_Q4_0, _Q4_1, _Q5_0, _Q5_1 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1)
_Q8_0, _Q8_1, _IQ4_NL = int(T.Q8_0), int(T.Q8_1), int(T.IQ4_NL)
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K, _Q8_K = (
    int(T.Q2_K),
    int(T.Q3_K),
    int(T.Q4_K),
    int(T.Q5_K),
    int(T.Q6_K),
    int(T.Q8_K),
)


@njit(cache=True)
def dequant_row_any(t, src, dst):
    """Dequantize one row of type id t inside njit code; returns False for an unknown id."""
    if t == _F32:
        dequant_row_f32(src, dst)
    elif t == _F16:
        dequant_row_f16(src, dst)
    elif t == _Q8_0:
        dequant_row_q8_0(src, dst)
    elif t == _Q4_0:
        dequant_row_q4_0(src, dst)
    elif t == _Q4_1:
        dequant_row_q4_1(src, dst)
    elif t == _Q5_0:
        dequant_row_q5_0(src, dst)
    elif t == _Q5_1:
        dequant_row_q5_1(src, dst)
    elif t == _IQ4_NL:
        dequant_row_iq4_nl(src, dst)
    elif t == _BF16:
        dequant_row_bf16(src, dst)
    elif t == _Q4_K:
        dequant_row_q4_K(src, dst)
    elif t == _Q6_K:
        dequant_row_q6_K(src, dst)
    elif t == _Q5_K:
        dequant_row_q5_K(src, dst)
    elif t == _Q3_K:
        dequant_row_q3_K(src, dst)
    elif t == _Q2_K:
        dequant_row_q2_K(src, dst)
    elif t == _Q8_1:
        dequant_row_q8_1(src, dst)
    elif t == _Q8_K:
        dequant_row_q8_K(src, dst)
    else:
        return False
    return True


@njit(cache=True)
def quant_row_any(t, src, dst):
    """Quantize one row to type id t inside njit code (cache types and q8_1); False if unknown."""
    if t == _F32:
        quant_row_f32(src, dst)
    elif t == _F16:
        quant_row_f16(src, dst)
    elif t == _Q8_0:
        quant_row_q8_0(src, dst)
    elif t == _Q4_0:
        quant_row_q4_0(src, dst)
    elif t == _Q4_1:
        quant_row_q4_1(src, dst)
    elif t == _Q5_0:
        quant_row_q5_0(src, dst)
    elif t == _Q5_1:
        quant_row_q5_1(src, dst)
    elif t == _IQ4_NL:
        quant_row_iq4_nl(src, dst)
    elif t == _BF16:
        quant_row_bf16(src, dst)
    elif t == _Q8_1:
        quant_row_q8_1(src, dst)
    else:
        return False
    return True


class TypeArg:
    """A ggml type id handed to a kernel as a compile-time constant: numba types it as
    ``Literal[int](id)`` (``_numba_type_``), so the kernel is specialized for that format and
    ``dequant_row_of`` / ``quant_row_of`` compile only its row function. Unboxed as the integer
    (``__index__``). One object per id (``type_arg``), so a call types it by attribute lookup."""

    __slots__ = ("id", "_numba_type_")

    def __init__(self, t: int):
        self.id = int(t)
        self._numba_type_ = types.IntegerLiteral(self.id)

    def __index__(self) -> int:
        return self.id

    __int__ = __index__

    def __repr__(self) -> str:
        return f"type_arg({self.id})"


_TYPE_ARGS: dict[int, TypeArg] = {}


def type_arg(t) -> TypeArg:
    """The TypeArg of ggml type id t (one shared object per id)."""
    a = _TYPE_ARGS.get(t)
    if a is None:
        a = _TYPE_ARGS[int(t)] = _TYPE_ARGS[t] = TypeArg(int(t))
        _TYPE_ARGS[a] = a  # type_arg(type_arg(t)) is type_arg(t)
    return a


_F16_PAIR = (type_arg(GGMLType.F16), type_arg(GGMLType.F16))


def kernel_cache_types(type_k, type_v):
    """(type_k, type_v) as the kernels over the K/V cache take them (attention, the Q/K/V store):
    an f16/f16 cache — the default, which every first run compiles before its first answer — as
    TypeArgs, so only f16's code is compiled (about half the compile of the flash and store
    kernels); any other pair as ints, one compiled version for all of them (a kv-sweep over
    many pairs compiles one kernel, not one per pair). The same row code runs either way."""
    if type_k == _F16 and type_v == _F16:
        return _F16_PAIR
    return int(type_k), int(type_v)


def row_selector(table: dict, fallback):
    """An njit-callable ``f(t, src, dst) -> bool`` that runs ``table[t](src, dst)``: for a literal
    t (a TypeArg) the entry is chosen while typing, so only that row function is compiled
    (False, compiled as a constant, for an id not in the table); a run-time integer t calls
    ``fallback(t, src, dst)`` (an if-chain over every format)."""

    def select(t, src, dst):
        raise NotImplementedError("only callable inside njit code")

    @overload(select, inline="always", prefer_literal=True)  # else numba tries the unliteral int first
    def _select(t, src, dst):
        if isinstance(t, types.IntegerLiteral):
            fn = table.get(t.literal_value)
            if fn is None:
                return lambda t, src, dst: False

            def one(t, src, dst):
                fn(src, dst)
                return True

            return one
        if isinstance(t, types.Integer):
            return lambda t, src, dst: fallback(t, src, dst)
        return None

    return select


dequant_row_of = row_selector({t: f.dequant_row for t, f in QUANT_TABLE.items()}, dequant_row_any)
quant_row_of = row_selector({t: f.quant_row for t, f in QUANT_TABLE.items() if f.quant_row is not None}, quant_row_any)


@njit(cache=True, parallel=True)
def _dequant_rows(raw, t, out):
    for r in prange(raw.shape[0]):  # raw [n_rows, row_bytes] u8 -> out [n_rows, n_cols] f32
        dequant_row_of(t, raw[r], out[r])


@njit(cache=True)
def _dequant_rows_ser(raw, t, out):
    """_dequant_rows on the calling thread: a token's embedding row is too little work for a
    parallel launch (kernels/parallel.py); the same row function, so the same values."""
    for r in range(raw.shape[0]):
        dequant_row_of(t, raw[r], out[r])


@njit(cache=True, parallel=True)
def _quant_rows(x, t, out):
    for r in prange(x.shape[0]):  # x [n_rows, n_cols] f32 -> out [n_rows, row_bytes] u8
        quant_row_of(t, x[r], out[r])


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: numba types read-only and writable arrays apart, so feeding the
    drivers one kind (model weights are read-only mmaps) keeps one compiled version each."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def dequantize(raw: np.ndarray, t: int, n_cols: int) -> np.ndarray:
    """raw u8 [n_rows, row_bytes] of type t -> f32 [n_rows, n_cols] (rows in parallel)."""
    t = int(t)
    if t not in QUANT_TABLE:
        type_info(t)  # raises the "not supported" message naming the format
        raise ValueError(f"no dequantizer for ggml type {t}")
    raw = _readonly(np.ascontiguousarray(raw, dtype=np.uint8))
    if raw.ndim == 1:
        raw = raw.reshape(1, -1)
    rb = row_bytes(t, n_cols)
    if raw.ndim != 2 or raw.shape[1] != rb:
        raise ValueError(f"{type_info(t).name} rows of {n_cols} values need {rb} bytes, got shape {raw.shape}")
    out = np.empty((raw.shape[0], n_cols), dtype=np.float32)  # [n_rows, n_cols] f32
    fn = _dequant_rows if raw.shape[0] >= parallel.DEQUANT_PAR_MIN_ROWS else _dequant_rows_ser
    fn(raw, type_arg(t), out)  # compiled for this format only
    return out


def quantize(x: np.ndarray, t: int) -> np.ndarray:
    """x f32 [n_rows, n_cols] -> u8 [n_rows, row_bytes] of type t (rows in parallel)."""
    t = int(t)
    if t not in QUANT_TABLE or QUANT_TABLE[t].quant_row is None:
        raise ValueError(f"cannot quantize to {type_info(t).name}: not a cache type")
    x = _readonly(np.ascontiguousarray(x, dtype=np.float32))
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"quantize expects [n_rows, n_cols], got shape {x.shape}")
    out = np.empty((x.shape[0], row_bytes(t, x.shape[1])), dtype=np.uint8)  # [n_rows, row_bytes]
    _quant_rows(x, type_arg(t), out)  # compiled for this format only
    return out
