"""A layer's fresh Q/K/V prepared and its K/V rows stored in the cache, in one launch.

For one generated token the attention layer's small steps — split of the QKV product, QK-norm,
RoPE (kernels/rope.py: prepare_qkv), then the K and V rows quantized into their cache cells
(kernels/kv_kernels.py: scatter_rows, once for K and once for V) — are each far less work than
the Python call and numba dispatch around them. Here they run as one kernel per layer.

The arithmetic is the unfused one: each token goes through rope._prep_token (the same inlined
code prepare_qkv runs), then its K row and V row through quants.quant_row_of (what
scatter_rows calls), so the cache bytes and the returned Q are bit-identical to the three
separate launches and every token's result depends on that token only (batch invariance;
tests/test_qkv_store.py asserts both). The memory context still decides where the rows go
(runtime/memory/kv_cache_context.py: attn_io's store gives the destination arrays and cells, as
llama.cpp's cpy_k returns a set_rows view); applying the ubatch and its rollback are unchanged.

Only for caches that store K and V as plain rows without a rotation: a transposed V cache
(flash attention off) or a Hadamard-rotated quantized cache goes the unfused way.
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.quants import kernel_cache_types, quant_row_of
from kvchat.kernels.rope import _prep_token


@njit(cache=True, inline="always")
def _store_token(t, k_out, v_out, k_dst, v_dst, strm, cell, type_k, type_v):
    """Quantize token t's K row (k_out [n, n_head_kv, dk] f32 -> [n_head_kv * dk]) and V row
    (v_out [n, n_embd_v] f32) into k_dst / v_dst u8 [n_stream, kv_size, row_bytes] at
    (strm[t], cell[t])."""
    quant_row_of(type_k, k_out[t].reshape(k_out.shape[1] * k_out.shape[2]), k_dst[strm[t], cell[t]])
    quant_row_of(type_v, v_out[t], v_dst[strm[t], cell[t]])


@njit(cache=True, inline="always")
def _scratch(q_out, k_in, v_in):
    """The roped K [n, n_head_kv, dk] and V [n, n_embd_v] f32 rows before they are quantized
    into the cache."""
    n, _, dk = q_out.shape
    return (np.empty((n, k_in.shape[1] // dk, dk), dtype=np.float32), np.empty((n, v_in.shape[1]), dtype=np.float32))


@njit(cache=True)
def _prep_store_tokens(
    t0,
    t1,
    q_in,
    k_in,
    v_in,
    pos,
    q_norm,
    k_norm,
    has_norm,
    eps,
    n_rot,
    theta_scale,
    fs,
    ff,
    mscale,
    neox,
    q_out,
    k_dst,
    v_dst,
    strm,
    cell,
    type_k,
    type_v,
    k_out,
    v_out,
):
    """Tokens t0 .. t1 - 1 prepared and stored, in turn (k_out / v_out: _scratch's rows). One
    compiled function that the serial and the parallel kernel both call, not inlined into them:
    the token's code is compiled once, and the parfor passes see a one-call prange body."""
    cs = np.empty((n_rot // 2, 2), dtype=np.float32)  # [half, (cos, sin)] f32
    for t in range(t0, t1):
        _prep_token(
            t,
            q_in,
            k_in,
            v_in,
            q_norm,
            k_norm,
            has_norm,
            eps,
            pos,
            n_rot,
            theta_scale,
            fs,
            ff,
            mscale,
            neox,
            q_out,
            k_out,
            v_out,
            cs,
        )
        _store_token(t, k_out, v_out, k_dst, v_dst, strm, cell, type_k, type_v)


def _prep_store_ser(
    q_in,
    k_in,
    v_in,
    pos,
    q_norm,
    k_norm,
    has_norm,
    eps,
    n_rot,
    theta_scale,
    fs,
    ff,
    mscale,
    neox,
    q_out,
    k_dst,
    v_dst,
    strm,
    cell,
    type_k,
    type_v,
):
    """q_in [n, n_head * dk], k_in [n, n_head_kv * dk], v_in [n, n_embd_v] f32 (C-contiguous);
    pos i32 [n]; q_norm / k_norm f32 [dk] (has_norm); RoPE constants as rope.rope_plan; q_out
    [n, n_head, dk] f32; k_dst / v_dst u8 [n_stream, kv_size, row_bytes]; strm, cell i64 [n];
    type_k, type_v ggml ids (quants.kernel_cache_types): _prep_store_par's arguments. The tokens in turn on this thread:
    plain Python around _prep_store_tokens, so that no kernel level sits above it (a first run
    compiles a kernel's callees again into every kernel that calls them: kernels/attention_flash.py's
    _flash_units says how)."""
    n, _, dk = q_out.shape
    k_out = np.empty((n, k_in.shape[1] // dk, dk), dtype=np.float32)  # _scratch's rows, allocated by numpy
    v_out = np.empty((n, v_in.shape[1]), dtype=np.float32)
    _prep_store_tokens(
        np.int64(0), np.int64(n), q_in, k_in, v_in, pos, q_norm, k_norm, has_norm, eps, n_rot, theta_scale,
        fs, ff, mscale, neox, q_out, k_dst, v_dst, strm, cell, type_k, type_v, k_out, v_out,
    )  # fmt: skip


@njit(cache=True, parallel=True)
def _prep_store_par(
    q_in,
    k_in,
    v_in,
    pos,
    q_norm,
    k_norm,
    has_norm,
    eps,
    n_rot,
    theta_scale,
    fs,
    ff,
    mscale,
    neox,
    q_out,
    k_dst,
    v_dst,
    strm,
    cell,
    type_k,
    type_v,
):
    """_prep_store_ser with tokens in parallel (a ubatch's slot cells are distinct)."""
    k_out, v_out = _scratch(q_out, k_in, v_in)
    for t in prange(q_out.shape[0]):
        _prep_store_tokens(
            np.int64(t),
            np.int64(t) + 1,
            q_in,
            k_in,
            v_in,
            pos,
            q_norm,
            k_norm,
            has_norm,
            eps,
            n_rot,
            theta_scale,
            fs,
            ff,
            mscale,
            neox,
            q_out,
            k_dst,
            v_dst,
            strm,
            cell,
            type_k,
            type_v,
            k_out,
            v_out,
        )


def prepare_qkv_store(q_in, k_in, v_in, pos, rope_args, n_head, n_head_kv, head_dim, dst):
    """Q [n, n_head, head_dim] f32 (normed and roped) of the fresh q_in/k_in/v_in, with K and V
    stored through dst = (k_dst, v_dst, strm, cell, type_k, type_v) (the memory context's
    attn_io(il).store, a KVStore). pos: i32 [n]; rope_args: (q_norm, k_norm, has_norm, eps, n_rot, theta_scale,
    freq_scale, factors, attn_factor, neox), the layer's constants (runtime/arch/blocks.py)."""
    n = q_in.shape[0]
    q = np.empty((n, n_head, head_dim), dtype=np.float32)
    # the column slices of a fused QKV projection are strided for several tokens and contiguous for
    # one, and numba compiles a kernel once per layout: copying a prompt's few KB a layer (a token's
    # are returned as they are) keeps one compiled version of the whole Q/K/V path
    q_in, k_in, v_in = np.ascontiguousarray(q_in), np.ascontiguousarray(k_in), np.ascontiguousarray(v_in)
    fn = _prep_store_par if n >= parallel.ROPE_PAR_MIN_TOKENS else _prep_store_ser
    k_dst, v_dst, strm, cell, type_k, type_v = dst
    type_k, type_v = kernel_cache_types(type_k, type_v)  # f16/f16: compile-time constants
    fn(q_in, k_in, v_in, pos, *rope_args, q, k_dst, v_dst, strm, cell, type_k, type_v)
    return q
