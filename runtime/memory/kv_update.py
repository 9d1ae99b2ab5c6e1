"""Deferred KV cache updates (llama_kv_cache::update): stream copies, K-shift, compaction.

These run between decodes (Context's memory update), never inside a ubatch:
- stream copy: seq_cp across streams only rewires cells; the K/V buffers follow here;
- K-shift: seq_add / seq_div change cell positions, but the cached keys were rotated for the
  old ones. RoPE is a rotation, so rotating by the pending delta gives the keys of the new
  position: dequantize -> rope_inplace(delta) -> requantize (exact for f32, within the format's
  rounding otherwise); a quantized cache holds Hadamard-rotated keys (runtime/memory/attn_rotation.py),
  so those are rotated back before RoPE and forward again after it, as llama.cpp does;
- compaction (optimize): move the cells above the holes down into them, so used_max_p1 and
  with it n_kv (the attention width) shrink to the number of used cells.
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.quants import dequantize, quantize
from kvchat.kernels.rope import rope_inplace
from kvchat.runtime.memory.attn_rotation import rotate
from kvchat.runtime.memory.kv_cells import CellsSnapshot


def rope_args(hp, il: int, kv_size: int) -> dict:
    """kvchat.kernels.rope keyword arguments of layer il (n_rot 0 for a NoPE layer); the cache's size
    is the context per sequence that picks LongRoPE factors (llama.cpp's build_rope_shift)."""
    if hasattr(hp, "rope_args"):
        return hp.rope_args(il, kv_size)
    base = hp.rope_freq_base_swa if hp.is_swa(il) else hp.rope_freq_base
    return dict(n_rot=hp.n_rot, freq_base=base, freq_scale=hp.rope_freq_scale)


def apply_k_shift(kv) -> None:
    """Re-rotate every cached key whose cell has a pending shift, in every layer and stream."""
    hp = kv.hparams
    neox = hp.rope_type == "neox"
    head_k = int(hp.n_embd_head_k)
    for strm, cells in enumerate(kv.cells):
        if not cells.get_has_shift():
            continue
        idxs = np.flatnonzero((cells.pos >= 0) & (cells.shift != 0))
        if idxs.size == 0:
            continue
        delta = cells.shift[idxs].astype(np.int32)  # [n] i32
        for layer in kv.layers:
            args = rope_args(hp, layer.il, kv.kv_size)
            if not args["n_rot"]:
                continue  # a NoPE layer's keys carry no position
            n = idxs.size
            x = dequantize(layer.k[strm, idxs], kv.type_k, layer.n_embd_k)  # [n, n_embd_k] f32
            if kv.n_rot_k:
                x = rotate(x, kv.n_rot_k)  # back to plain keys
            x = x.reshape(n, layer.n_embd_k // head_k, head_k)  # [n, n_head_kv, head_dim]
            rope_inplace(x, delta, neox=neox, **args)
            x = x.reshape(n, layer.n_embd_k)
            if kv.n_rot_k:
                x = rotate(x, kv.n_rot_k)
            layer.k[strm, idxs] = quantize(x, kv.type_k)


def copy_streams(kv, copies) -> None:
    """Copy whole K/V streams src -> dst (the data half of a cross-stream seq_cp)."""
    for src, dst in copies:
        for layer in kv.layers:
            layer.k[dst] = layer.k[src]
            layer.v[dst] = layer.v[src]


def compact(kv) -> bool:
    """Move used cells into the holes below them, K/V rows included; True if anything moved."""
    moved = False
    for strm, cells in enumerate(kv.cells):
        n_used = cells.get_used()
        used = cells.used_cells()
        src = used[used >= n_used]  # cells above the compact prefix
        if src.size == 0:
            continue
        dst = np.flatnonzero(cells.pos[:n_used] < 0).astype(np.int32)  # the holes
        assert dst.size == src.size
        snap = cells.cp(src)
        empty = CellsSnapshot(
            src,
            np.full(src.size, -1, np.int32),
            np.zeros(src.size, np.int32),
            np.full(src.size, -1, np.int32),
            np.zeros_like(snap.seq),
        )
        cells.set(empty)
        cells.set(CellsSnapshot(dst, snap.pos, snap.shift, snap.ext, snap.seq))
        kv.write_rows(strm, dst, kv.read_rows(strm, src))
        kv.heads[strm] = n_used
        moved = True
    return moved
