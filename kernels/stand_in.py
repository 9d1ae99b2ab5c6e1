"""Exact stand-in formats for a first run: a matrix whose format has no compiled kernel yet is held
in a format the run compiles anyway, when that format holds the same numbers and the integer kernel
computes the same bits with it.

Why: a first run compiles one integer-matmul kernel per weight format (~7 s CPU each here,
docs/performance.md "Cold start"), and a K-quant mix often carries a legacy format for a few
tensors. Gemma-3-270M's Q4_K_M file has four: Q8_0 (the head, some attn_v), Q5_0 (q, k, gate, up:
rows of 640 values, not a multiple of 256), Q4_K and Q6_K. A Q5_0 block is a scale d (f16) and 32
values q - 16 with q in 0..31; a Q8_0 block with the same d and the bytes q - 16 holds the same
numbers. kernels/matmul_int.py forms each block's integer dot exactly (a Q5_0 block as
dot(q, x) - 16 * sum(x), a Q8_0 block as dot(q - 16, x): the same integer) and then takes the same
float steps (both read q8_0 activations, one scale per block), so every product is bit-identical
(tests/test_stand_in.py). Q4_0 (values q - 8) is held the same way.

Held as Q8_0, the first run compiles one format fewer before its first answer; the native kernels
are planned after everything else (runtime/startup/compile_worker.py), and a later load, finding
them in numba's cache, holds the matrix in its own format again (Q8_0 bytes are 1.55x Q5_0's:
Gemma-3's tg128 ~5 % slower held as Q8_0, docs/performance.md). Only a run that compiles its
kernels in workers stands formats in (``first_run_formats(..., enabled=True)``): the plan is what
compiles the native kernels for the next run. A stand-in packing is cached (runtime/weights/cache.py)
under the kind ``int:Q8_0``; ``usable`` says when such a cached packing may be mapped.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from kvchat.kernels.ggml_types import GGMLType

# a format -> the format that holds its blocks exactly (same scale, same integers, same float steps)
STAND_INS = {GGMLType.Q5_0: GGMLType.Q8_0, GGMLType.Q4_0: GGMLType.Q8_0}
KIND = "int:"  # a packing's kind when held as another format, e.g. "int:Q8_0" (native: "int")

_held: dict = {}  # file type -> held type, for the load in progress (first_run_formats)


def held_as(t: int) -> int | None:
    """The type matrices of file type t are held as in the load in progress, else None."""
    return _held.get(int(t))


def kind_of(held: int) -> str:
    return KIND + GGMLType(held).name


def held_of(kind: str) -> int | None:
    """The held type a packing's kind names ("int:Q8_0"), None for a native packing."""
    if not kind.startswith(KIND):
        return None
    return int(GGMLType[kind[len(KIND) :]])


def usable(kind: str, t: int) -> bool:
    """May a cached packing of this kind serve a matrix of file type t in this load? A native one
    always (its kernel compiles if it must, as before stand-ins); a stand-in only while the same
    stand-in applies (once the native kernel is cached, the matrix is repacked in its own format)."""
    held = held_of(kind)
    return held is None or held_as(t) == held


def as_held(raw: np.ndarray, t: int, held: int) -> np.ndarray:
    """raw u8 [m, row_bytes] of type t -> the same rows as type held (STAND_INS), exactly."""
    if STAND_INS.get(GGMLType(t)) != held:
        raise ValueError(f"stand_in: {GGMLType(t).name} is not held as {GGMLType(held).name}")
    m = raw.shape[0]
    size = 22 if t == GGMLType.Q5_0 else 18
    blocks = raw.reshape(m, -1, size)  # [m, nb, block bytes]
    qs = blocks[:, :, size - 16 :]  # [m, nb, 16]: value j in the low nibble, value 16 + j in the high one
    values = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [m, nb, 32] u8
    if t == GGMLType.Q5_0:
        qh = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")  # [m, nb, 1]: bit j is value j's bit 4
        values |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        offset = 16
    else:
        offset = 8
    out = np.empty((m, blocks.shape[1], 34), np.uint8)  # q8_0 blocks: d, then 32 signed bytes
    out[:, :, :2] = blocks[:, :, :2]
    out[:, :, 2:] = (values.astype(np.int16) - offset).astype(np.int8).view(np.uint8)
    return out.reshape(m, -1)


@contextmanager
def first_run_formats(types, ready, enabled: bool = True):
    """Around one model's load: types are its matrices' file types, ready(t) whether type t's
    serial kernel is compiled (kernels/matmul.format_ready); yields {file type: held type} for the
    stand-ins chosen — a format is held as STAND_INS's when its own kernel is not compiled and
    the held format's is needed or ready anyway."""
    global _held
    chosen = {}
    if enabled:
        types = {int(t) for t in types}
        for t, held in STAND_INS.items():
            if int(t) in types and (int(held) in types or ready(held)) and not ready(t):
                chosen[int(t)] = int(held)
    before, _held = _held, chosen
    try:
        yield dict(chosen)
    finally:
        _held = before
