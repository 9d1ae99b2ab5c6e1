"""Live cache-type conversion: re-store every cell of a KV cache in new K/V types, in place.

Each layer's K and V rows are decoded from the old type, un-rotated if the old type was stored
Hadamard-rotated, rotated for the new type if it is quantized (attn_rotation.rotation_sizes),
and quantized again. Cells, positions, sequences, heads and pending shifts are untouched, so a
conversation goes on from exactly where it was. All new buffers are built before any is
swapped in: a conversion that fails (a type that cannot hold V with flash attention off, out of
memory) leaves the cache as it was.

Used by the chat's `/set cache-type-k TYPE` / `/set cache-type-v TYPE`.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.ggml_types import cache_type_by_name, row_bytes, type_info
from kvchat.kernels.quants import dequantize, quantize
from kvchat.runtime.memory.attn_rotation import rotate, rotation_sizes
from kvchat.runtime.memory.interface import MemoryOpError


def _type_id(t) -> int:
    return int(t) if isinstance(t, (int, np.integer)) else cache_type_by_name(t).type_id


def _elem_bytes(t: int) -> int:
    info = type_info(t)
    return info.type_size if info.block_size == 1 else 0


def _convert_rows(raw: np.ndarray, n: int, t_old: int, rot_old: int, t_new: int, rot_new: int) -> np.ndarray:
    """u8 [rows, row_bytes(t_old, n)] -> u8 [rows, row_bytes(t_new, n)] through f32, rotations swapped."""
    x = dequantize(raw, t_old, n)  # f32 [rows, n]
    if rot_old:
        x = rotate(x, rot_old)  # self-inverse: back to the plain values
    if rot_new:
        x = rotate(x, rot_new)
    return quantize(x, t_new)


def _plan_cache(kv, tk: int, tv: int) -> tuple:
    """New (k, v) arrays per layer and the new rotation sizes; kv itself is not touched."""
    if kv.v_trans and _elem_bytes(tv) == 0:
        raise MemoryOpError(
            f"a {type_info(tv).name} V cache needs flash attention (V is stored "
            f"transposed without it); restart with -fa on to use it"
        )
    rk, rv = rotation_sizes(kv.hparams, tk, tv)
    new = []
    for layer in kv.layers:
        ns, size, _ = layer.k.shape
        k = _convert_rows(layer.k.reshape(ns * size, -1), layer.n_embd_k, kv.type_k, kv.n_rot_k, tk, rk)
        k = k.reshape(ns, size, row_bytes(tk, layer.n_embd_k))
        if kv.v_trans:  # [ns, n_embd_v, size * el]: each row holds one component of every cell
            nv = layer.n_embd_v
            v = quantize(dequantize(layer.v.reshape(ns * nv, -1), kv.type_v, size), tv)
            v = v.reshape(ns, nv, size * _elem_bytes(tv))
        else:
            v = _convert_rows(layer.v.reshape(ns * size, -1), layer.n_embd_v, kv.type_v, kv.n_rot_v, tv, rv)
            v = v.reshape(ns, size, row_bytes(tv, layer.n_embd_v))
        new.append((k, v))
    return new, rk, rv


def convert_cache_types(memory, type_k, type_v) -> bool:
    """Re-store every KV cache of `memory` as type_k / type_v (names or ggml ids). False if the
    types are already these; MemoryOpError (memory unchanged) if V cannot take the type."""
    caches = memory.kv_caches()
    if not caches:
        raise MemoryOpError("this model's memory has no KV cache to convert")
    tk, tv = _type_id(type_k), _type_id(type_v)
    if all(kv.type_k == tk and kv.type_v == tv for kv in caches):
        return False
    plans = [_plan_cache(kv, tk, tv) for kv in caches]  # everything built before anything changes
    for kv, (new, rk, rv) in zip(caches, plans):
        for layer, (k, v) in zip(kv.layers, new):
            layer.k, layer.v = k, v
        kv.type_k, kv.type_v = tk, tv
        kv.n_rot_k, kv.n_rot_v = rk, rv
        if hasattr(kv, "v_elem_bytes"):
            kv.v_elem_bytes = _elem_bytes(tv)
        # layer_of aliases the same KVLayer objects, so the forward pass sees the new arrays
    return True


def convert_context_cache_types(ctx, type_k: str, type_v: str) -> bool:
    """convert_cache_types on a Context's memory, keeping its parameters (what session files
    record) in step."""
    changed = convert_cache_types(ctx.memory, type_k, type_v)
    if changed:
        ctx.cparams.type_k, ctx.cparams.type_v = _type_id(type_k), _type_id(type_v)
        ctx.params.type_k, ctx.params.type_v = type_info(ctx.cparams.type_k).name, type_info(ctx.cparams.type_v).name
    return changed
