"""Attention over the KV cache, reading K and V rows in their cache format (never a float copy).

Two paths, as llama.cpp's build_attn_mha:
- flash (``flash_attn_ext``): online softmax over K/V tiles; V rows are ``[n_kv, n_embd_v_gqa]``.
- classic (flash off): KQ for all cells, masked softmax, then KQV against the transposed V cache
  ``[n_embd_v_gqa, kv_size]`` (f32/f16/bf16 elements only, like llama.cpp).

Batch invariance: the output row of a query (token, head) is bit-identical whatever else is in the
call — how many tokens, which ones, how many cells beyond those it sees (n_kv), how many threads,
serial or parallel, split or not. Cached K/V are rounded to the cache type, so any last-bit
difference between decoding a text token by token and in batches would flip roundings of stored
values and grow over the layers. So every sum is cut at fixed boundaries counted from cell 0, taken from
the row's start cell on (0, or for a sliding-window ring the cell of its oldest position, so
the ring's size does not change the order; see `attention`) and spelled out operation by
operation:
- no fast-math anywhere: with reassoc/contract LLVM picks a summation order or an FMA per loop
  nest, and the same source then rounds differently in the serial and the parallel kernel — or
  in one kernel depending on whether a helper was inlined fresh or linked from numba's on-disk
  cache (measured: 1-ulp differences that came and went with the cache state);
- the dot products and sums use the explicit vectors of kernels/simd.py: K·q of a cell is 16
  lane fma chains over its components in order, then one fixed tree (vhsum); P·V is one fma
  chain per component over the cells in order; a tile of KT probabilities is summed in one tree;
- tiles of KT cells are always processed at full width: cells past n_kv get score -inf (p = 0)
  and zero K/V, so where the valid cells end never changes an operation;
- flash: chunks of CHUNK cells, each an online softmax from a fresh state, folded into the
  query's result in chunk order (``_fold``), whether one unit walks all chunks or the chunks
  are spread over threads and folded afterwards (flash-decoding, for few queries);
- classic: the softmax sum and each P·V component are 16 lane chains over the visible tiles,
  then one tree (KVCHAT_GGML_ORDER=1: the sum in ggml's form, below).
Tiles and chunks that a query cannot see contribute nothing (skipped, or exact zeros).

Head sizes: any, for K and V separately. The tiles, the unit's queries and the V accumulators
are LANES wide per head rounded up, the components past the head size zero (load_tile never
writes them): a zero component adds exactly nothing to a K·q chain, and a padded P·V component
is dropped at the end. For the common sizes (64, 80, 96, 128, 256: multiples of LANES) the
padding is empty and the code is the same; the padding depends on the head size only, so it
cannot break batch invariance.

Work split (one parallel launch per layer): a unit is (kv head, group of its query heads, block
of tokens[, chunk]). Each unit dequantizes a tile of KT cache rows of its kv head once, into a
small f32 buffer, and reuses it for every query of the unit — GQA heads and a block of prompt
tokens — so dequantization is amortized in prefill and parallel in decode. Tiles that the mask
hides for every token of the block are skipped (causal prefill touches only the lower triangle).

This module dispatches (`attention`, `attention_checked`: a launch plan per call shape). The flash
path is kernels/attention_flash.py (hot loop `_chunk`: per unit and chunk, K/V tiles decoded once,
then each query's scores and online-softmax step); the classic path is
kernels/attention_classic.py; the tile-level pieces (cache decode, scores, a tile's
online-softmax step) are kernels/attention_tiles.py.

Numerics: ggml converts Q to K's vec-dot type before K·Q: 8-bit blocks for a quantized K and
bf16 for a bf16 K on every path; for an f16 K, f16 on the classic path (a mul_mat, any batch) and
on flash's one-row path, not on flash's tiled prefill path (>= 64 queries), whose order kvchat's
flash kernel keeps for every batch size. ``round_q_to_vec_dot_type`` is that rounding; the forward
applies it (runtime/arch/blocks.py: round_q_like_ggml), so ``attention(round_q=...)`` stays False
there. The classic path rounds the probabilities to V's dot type (f16 / bf16) before P·V, as
ggml's mul_mat does; with KVCHAT_GGML_ORDER=1 its softmax also takes ggml's form (ggml_v_expf of
this CPU, 16-cell trees summed in double, p = e * (float)(1 / sum)) and the path equals ggml-cpu's
AVX-512 build of llama.cpp's non-flash graph bit for bit
(tests/helpers/ggml_order.classic_attention_reference; KQ and P·V as llamafile's f16 gemm: 16
lane chains, then _mm512_reduce_add_ps's tree, which vhsum is). By default the softmax keeps libm
expf and its 16 lane sums, whose bits do not depend on where a sliding window's cells sit in its
ring. With the same opt-in, flash attention over f16/f32 K and V runs ggml's tiled order
(kernels/attention_ggml.py). On an AVX2-only CPU ggml's gemm and softmax run 8 lanes, which these
kernels do not mirror.
"""

import numpy as np

from kvchat.kernels import parallel
from kvchat.kernels.attention_classic import classic_attn_par, classic_attn_ser, classic_n_units, classic_plan
from kvchat.kernels.attention_flash import _NO_PARTIALS, CHUNK, _flash_attn_par, _partials, flash_attn_ser, flash_plan
from kvchat.kernels.attention_ggml import ggml_flash_par, ggml_flash_ser, ggml_flash_units
from kvchat.kernels.ggml_types import GGMLType, type_info
from kvchat.kernels.qlayout import GGML_ORDER_PARTS
from kvchat.kernels.quants import dequantize, kernel_cache_types, quantize

GGML_FLASH = "flash" in GGML_ORDER_PARTS  # ggml's tiled flash order (KVCHAT_GGML_ORDER, kernels/qlayout.py)
GGML_SOFTMAX = "softmax" in GGML_ORDER_PARTS  # ggml's soft_max_f32 form on the classic path
_F32, _F16, _BF16, _Q8_0 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16), int(GGMLType.Q8_0)


def round_q_to_vec_dot_type(q, type_k):
    """Round Q to the vec-dot type ggml's CPU backend converts it to before K·Q.

    f16 K -> f16, bf16 K -> bf16, quantized K -> 8-bit blocks (q8_0 / q8_1 share values).
    q: [n_tokens, n_head, dk] f32 -> same shape f32 (a new array; f32 K returns q itself).
    """
    if type_k == _F32:
        return q
    if type_k == _F16:
        return q.astype(np.float16).astype(np.float32)
    if type_k == _BF16:
        return dequantize(quantize(q.reshape(-1, q.shape[-1]), _BF16), _BF16, q.shape[-1]).reshape(q.shape)
    flat = q.reshape(-1, q.shape[-1])  # [n_tokens * n_head, dk]; a quantized K's dk is a multiple of 32
    return dequantize(quantize(flat, _Q8_0), _Q8_0, q.shape[-1]).reshape(q.shape)


def attention(
    q,
    k,
    type_k,
    v,
    type_v,
    mask,
    tok_stream,
    n_head_kv,
    scale,
    softcap=0.0,
    flash=True,
    n_threads=2,
    round_q=False,
    start=None,
    sinks=None,
):
    """Attention of fresh queries over the cache.

    q: [n_tokens, n_head, dk] f32; k: (u8 [n_stream, n_kv, row_k], type_k) cache view;
    v: flash -> u8 [n_stream, n_kv, row_v]; classic -> transposed u8 [n_stream, n_embd_v_gqa, kv_size*elem];
    mask: [n_tokens, n_kv] f32 (0 / -inf); tok_stream: [n_tokens] i32.
    start: None (cell 0) or [n_tokens] ints in [0, n_kv): the cell where each row's sums begin,
    taken cyclically from its tile. A sliding-window cache is a ring (a position lives in cell
    pos % kv_size once it wraps), so with start = the cell of the oldest position a row sees the
    cells are folded in position order, and the row's bits do not depend on the ring's size
    (kv_size is a multiple of CHUNK). Cells before start in its chunk are folded last.
    sinks: None or f32 [n_head], a learned logit per head that joins its softmax (gpt-oss).
    Returns [n_tokens, n_head * dv] f32 (heads concatenated, ready for the output projection).
    Each row depends only on its own query, mask row, start and the cells it sees (module docstring).
    """
    n_tokens = q.shape[0]
    n_kv = mask.shape[1]
    qr = round_q_to_vec_dot_type(q, int(type_k)) if round_q else q
    qr = np.ascontiguousarray(qr, dtype=np.float32)
    mask = np.ascontiguousarray(mask, dtype=np.float32)
    ts = np.ascontiguousarray(tok_stream, dtype=np.int32)
    if start is not None:
        start = np.ascontiguousarray(start, dtype=np.int64)
        if start.shape != (n_tokens,) or (n_tokens and (start.min() < 0 or start.max() >= max(n_kv, 1))):
            raise ValueError(f"attention: start must be {n_tokens} cells in [0, {n_kv})")
    return attention_checked(
        qr,
        k,
        int(type_k),
        v,
        int(type_v),
        mask,
        ts,
        start,
        int(n_head_kv),
        np.float32(scale),
        np.float32(softcap),
        bool(flash),
        n_threads,
        NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32),
    )


NO_SINKS = np.zeros(0, dtype=np.float32)  # no attention sinks: the kernels skip them


def attention_checked(
    q,
    k,
    type_k,
    v,
    type_v,
    mask,
    tok_stream,
    start,
    n_head_kv,
    scale,
    softcap,
    flash,
    n_threads,
    sinks=NO_SINKS,
    par_min=None,
):
    """attention() for a caller whose arguments are already in the kernels' types, as the
    forward pass's are (runtime/arch/blocks.py): q C-contiguous f32 [n_tokens, n_head, dk],
    mask C-contiguous f32 [n_tokens, n_kv], tok_stream C-contiguous i32 [n_tokens], start None or
    C-contiguous i64 [n_tokens] in [0, n_kv), type_k / type_v / n_head_kv ints, scale and softcap
    np.float32, flash a bool, sinks C-contiguous f32 [n_head] or NO_SINKS. Same kernels, same
    results; the conversions and checks a generated
    token does not need (30 layers a token) are left to attention(). par_min: the work from which
    the call splits over the threads (None: kernels.parallel.ATTN_PAR_MIN_MACS; a generated
    token's step may pass a lower one, layer_plan.Launch)."""
    n_tokens, n_head, dk = q.shape
    n_kv = mask.shape[1]
    key = (
        flash,
        n_tokens,
        n_head,
        dk,
        n_head_kv,
        n_kv,
        k.shape[0],
        type_v,
        v.shape[2] if flash else v.shape[1],
        n_threads,
        parallel.ATTN_PAR_MIN_MACS if par_min is None else par_min,
    )
    plan = _LAUNCHES.get(key)
    if plan is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:  # prefill shapes vary; generation repeats a few
            _LAUNCHES.clear()
        plan = _LAUNCHES[key] = _launch_plan(*key)
    fn, tb, split, cpu, n_units, dv, start0 = plan
    out = np.empty((n_tokens, n_head, dv), dtype=np.float32)
    if flash and GGML_FLASH and type_k == type_v and type_k in (_F16, _F32) and sinks.shape[0] == 0:
        par = fn is _flash_attn_par  # ggml's tiled order (kernels/attention_ggml.py), opt-in
        tb, hpu, n_units = ggml_flash_units(n_tokens, n_head, n_head_kv, n_threads if par else 1)
        (ggml_flash_par if par else ggml_flash_ser)(
            q, k, type_k, v, type_v, mask, start0 if start is None else start, tok_stream, n_head_kv, scale,
            softcap, tb, hpu, n_units, out,
        )  # fmt: skip
        return out.reshape(n_tokens, n_head * dv)
    type_k, type_v = kernel_cache_types(type_k, type_v)  # f16/f16: compile-time constants
    if flash:
        pm, ps, pacc, bm, bs, bacc = _partials(n_kv, n_tokens, n_head, dv) if split else _NO_PARTIALS
        fn(
            q,
            k,
            type_k,
            v,
            type_v,
            mask,
            start0 if start is None else start,
            tok_stream,
            n_head_kv,
            scale,
            softcap,
            sinks,
            tb,
            split,
            cpu,
            n_units,
            pm,
            ps,
            pacc,
            bm,
            bs,
            bacc,
            out,
        )
    else:
        fn(
            q,
            k,
            type_k,
            v,
            type_v,
            mask,
            start0 if start is None else start,
            tok_stream,
            n_head_kv,
            scale,
            softcap,
            sinks,
            tb,
            split,
            n_units,
            GGML_SOFTMAX,  # the softmax sum in ggml's form (see attention_classic), opt-in
            out,
        )  # classic: (tb, heads per group, n_units)
    return out.reshape(n_tokens, n_head * dv)


_LAUNCHES: dict = {}  # the launch plan of each call shape seen (a generated token repeats one or two)
_MAX_LAUNCHES = 256


def _launch_plan(flash, n_tokens, n_head, dk, n_head_kv, n_kv, n_stream, type_v, v_width, n_threads, par_min):
    """How attention_checked launches a call of this shape: (kernel, token block, split or
    heads per group, chunks per unit, units, head size of V, zero start cells i64 [n_tokens]).
    The start cells are shared by every call of the shape (the kernels only read them)."""
    dv = _values_per_bytes(type_v, v_width // n_head_kv) if flash else v_width // n_head_kv
    par = n_threads > 1 and n_tokens * n_head * n_kv * dk >= par_min
    start0 = np.zeros(n_tokens, dtype=np.int64)
    if flash:
        tb, split, cpu = flash_plan(n_tokens, n_head_kv, n_kv, n_stream, n_threads if par else 1)
        n_ch = -(-n_kv // CHUNK)
        n_units = n_head_kv * -(-n_tokens // tb) * (-(-n_ch // cpu) if split else 1)
        return (_flash_attn_par if par else flash_attn_ser, int(tb), bool(split), int(cpu), int(n_units), dv, start0)
    tb, hpg = classic_plan(n_tokens, n_head, n_head_kv, n_stream, n_threads if par else 1)
    n_units = classic_n_units(np.empty((n_tokens, n_head, 0), dtype=np.float32), n_head_kv, tb, hpg)
    return classic_attn_par if par else classic_attn_ser, int(tb), int(hpg), 0, int(n_units), dv, start0


def _values_per_bytes(t, nbytes):
    """How many values nbytes of format t hold."""
    ti = type_info(t)
    return nbytes // ti.type_size * ti.block_size
