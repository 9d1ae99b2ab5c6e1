"""The table of ggml block formats: ids, block geometry, and which ones may hold a KV cache.

A ggml tensor row of n values in a block format is n / block_size blocks of type_size bytes
each. The ids and sizes are ggml's (ggml.h / ggml.c type_traits) because GGUF files and
session files store them verbatim. Every id ggml has ever assigned is named here so the model
loader can say *which* format it cannot handle; only the ones kernels/quants.py implements are
in ``TYPES``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class GGMLType(IntEnum):
    """ggml type ids, as stored in GGUF tensor infos (enum ggml_type)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


class TypeInfo(NamedTuple):
    """One block format. ``name`` is ggml's lower-case type name ("q8_0", "q4_K")."""

    name: str
    type_id: int
    block_size: int  # values per block
    type_size: int  # bytes per block
    kv_ok: bool  # allowed as a KV cache type (--cache-type-k/-v)


QK = 32  # block size of the legacy formats (q4_0 ... q8_1, iq4_nl)
QK_K = 256  # super-block size of the k-quants

_T = GGMLType
_ALL = [
    # name       id          block  bytes  kv_ok
    ("f32", _T.F32, 1, 4, True),
    ("f16", _T.F16, 1, 2, True),
    ("q4_0", _T.Q4_0, QK, 2 + 16, True),  # half d, 32 nibbles
    ("q4_1", _T.Q4_1, QK, 4 + 16, True),  # half d, half m, 32 nibbles
    ("q5_0", _T.Q5_0, QK, 2 + 4 + 16, True),  # half d, 32 high bits, 32 nibbles
    ("q5_1", _T.Q5_1, QK, 4 + 4 + 16, True),  # half d, half m, 32 high bits, 32 nibbles
    ("q8_0", _T.Q8_0, QK, 2 + 32, True),  # half d, 32 int8
    ("q8_1", _T.Q8_1, QK, 4 + 32, False),  # half d, half s (= d * sum qs), 32 int8
    ("q2_K", _T.Q2_K, QK_K, 16 + 64 + 4, False),
    ("q3_K", _T.Q3_K, QK_K, 32 + 64 + 12 + 2, False),
    ("q4_K", _T.Q4_K, QK_K, 4 + 12 + 128, False),
    ("q5_K", _T.Q5_K, QK_K, 4 + 12 + 32 + 128, False),
    ("q6_K", _T.Q6_K, QK_K, 128 + 64 + 16 + 2, False),
    ("q8_K", _T.Q8_K, QK_K, 4 + 256 + 32, False),  # f32 d, 256 int8, 16 int16 bsums
    ("iq4_nl", _T.IQ4_NL, QK, 2 + 16, True),  # half d, 32 nibbles into a non-linear table
    ("bf16", _T.BF16, 1, 2, True),
    ("mxfp4", _T.MXFP4, QK, 1 + 16, False),  # e8m0 exponent e, 32 e2m1 nibbles (weights only: gpt-oss)
]

# Known to ggml but not implemented by kernels/quants.py (sizes kept so a loader can still
# bound-check and skip such a tensor).
_UNSUPPORTED = [
    ("iq2_xxs", _T.IQ2_XXS, QK_K, 66),
    ("iq2_xs", _T.IQ2_XS, QK_K, 74),
    ("iq3_xxs", _T.IQ3_XXS, QK_K, 98),
    ("iq1_s", _T.IQ1_S, QK_K, 50),
    ("iq3_s", _T.IQ3_S, QK_K, 110),
    ("iq2_s", _T.IQ2_S, QK_K, 82),
    ("iq4_xs", _T.IQ4_XS, QK_K, 136),
    ("i8", _T.I8, 1, 1),
    ("i16", _T.I16, 1, 2),
    ("i32", _T.I32, 1, 4),
    ("i64", _T.I64, 1, 8),
    ("f64", _T.F64, 1, 8),
    ("iq1_m", _T.IQ1_M, QK_K, 56),
    ("tq1_0", _T.TQ1_0, QK_K, 54),
    ("tq2_0", _T.TQ2_0, QK_K, 66),
    ("nvfp4", _T.NVFP4, 64, 36),
    ("q1_0", _T.Q1_0, 128, 18),
    ("q2_0", _T.Q2_0, 64, 18),
]

# Supported formats (kernels/quants.py can dequantize every one of these).
TYPES: dict[int, TypeInfo] = {int(t): TypeInfo(n, int(t), b, s, kv) for n, t, b, s, kv in _ALL}
# Formats ggml knows that kvchat does not implement: id -> TypeInfo (kv_ok always False).
UNSUPPORTED_TYPES: dict[int, TypeInfo] = {int(t): TypeInfo(n, int(t), b, s, False) for n, t, b, s in _UNSUPPORTED}
# Cache types in the order ggml's --cache-type help lists them.
KV_CACHE_TYPES: tuple[str, ...] = tuple(i.name for i in TYPES.values() if i.kv_ok)

_BY_NAME: dict[str, TypeInfo] = {i.name.lower(): i for i in TYPES.values()}


def type_name(t: int) -> str:
    """ggml's name for any type id, supported or not ("iq2_xxs"); "type <id>" if unknown."""
    t = int(t)
    info = TYPES.get(t) or UNSUPPORTED_TYPES.get(t)
    return info.name if info else f"type {t}"


def is_supported(t: int) -> bool:
    return int(t) in TYPES


def type_info(t: int) -> TypeInfo:
    """TypeInfo of a supported format; ValueError naming the format when it is not."""
    t = int(t)
    info = TYPES.get(t)
    if info is not None:
        return info
    if t in UNSUPPORTED_TYPES:
        raise ValueError(
            f"ggml type {UNSUPPORTED_TYPES[t].name} (id {t}) is not supported by kvchat; "
            f"supported: {', '.join(i.name for i in TYPES.values())}"
        )
    raise ValueError(f"unknown ggml type id {t}")


def type_by_name(name: str) -> TypeInfo:
    """Supported format by name, case-insensitive ("Q8_0", "f16", "q4_k").

    ValueError for an unknown name, listing the valid cache types (the names a user types).
    A known non-cache format is returned; check ``.kv_ok`` or use ``cache_type_by_name``.
    """
    info = _BY_NAME.get(str(name).strip().lower())
    if info is None:
        raise ValueError(f"unknown type '{name}'; valid cache types: {', '.join(KV_CACHE_TYPES)}")
    return info


def cache_type_by_name(name: str) -> TypeInfo:
    """Like type_by_name, but also refuses formats that cannot hold a KV cache (q4_K...)."""
    info = _BY_NAME.get(str(name).strip().lower())
    if info is None or not info.kv_ok:
        raise ValueError(f"invalid cache type '{name}'; valid cache types: {', '.join(KV_CACHE_TYPES)}")
    return info


def row_bytes(t: int, n: int) -> int:
    """Bytes of a row of n values of format t; ValueError unless n is a multiple of the block."""
    info = type_info(t)
    if n < 0 or n % info.block_size != 0:
        raise ValueError(f"row of {n} values is not a multiple of the {info.name} block size {info.block_size}")
    return n // info.block_size * info.type_size
