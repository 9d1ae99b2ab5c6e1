"""The classic attention path (flash attention off, as llama.cpp's build_attn_mha without
flash_attn_ext): KQ for all cells, a masked softmax, then KQV against the transposed V cache
[n_embd_v_gqa, kv_size] (f32/f16/bf16 elements only). Its hot loop is `_classic_unit`'s: per
(kv head, head group, token block) unit, K tiles decoded once and scored for every query, then
per query the softmax (16 lane sums; KVCHAT_GGML_ORDER=1: ggml's soft_max_f32 form, its exp and
16-cell trees summed in double) and 16 fma lane chains per V component over the visible tiles,
from the query's start tile on, the probabilities in V's dot type as ggml's mul_mat converts them.
kernels/attention.py dispatches to it and states the batch-invariance rules and the numerics it
keeps.
"""

import math

import numpy as np
from numba import njit, prange

from kvchat.kernels.attention_tiles import (
    KT,
    NEG_INF,
    dequant_cache_row,
    load_tile,
    mask_tile,
    tile_dots1,
    tile_dots4,
    tile_live,
    tile_scores,
)
from kvchat.kernels.ggml_math import vexpf_ggml
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.simd import (
    LANES,
    vadd,
    vbcast,
    vfma,
    vhsum,
    vload,
    vmul,
    vround_bf16,
    vround_f16,
    vstore,
    vsub,
    vzero,
)

_F32, _F16, _BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)


@njit(cache=True, inline="always")
def _unit_coords(u, n_tb, n_sub):
    """Unit index -> (token block, head sub-group, kv head). Token blocks are visited in a
    zig-zag so that the contiguous ranges numba hands each thread get light and heavy
    (late, long-context) causal blocks alike."""
    i = u % n_tb
    tbi = i // 2 if i % 2 == 0 else n_tb - 1 - i // 2
    rest = u // n_tb
    return tbi, rest % n_sub, rest // n_sub


@njit(cache=True, inline="always")
def _classic_unit(
    u, q, k, type_k, vt, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, hpg, gsum, out
):
    """One work unit of the classic path: V is transposed, vt [n_stream, n_embd_v_gqa, >= n_kv * elem]
    u8. KQ for all cells -> masked softmax -> out[d] = sum_j p_j * V^T[d, j]. The softmax sum and
    each output are 16 lane chains over the visible tiles in cell order from the query's start
    tile on (cyclically), then one fixed tree; tiles the query cannot see are skipped, so cells
    past the ones it sees never enter a sum."""
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    n_kv = mask.shape[1]
    n_tiles = (n_kv + KT - 1) // KT
    n_kvp = n_tiles * KT
    gq = n_head // n_head_kv
    n_sub = gq // hpg
    n_tb = (n_tokens + tb - 1) // tb
    kb = k.shape[2] // n_head_kv
    eb = 4 if type_v == _F32 else 2  # bytes per V element (f32, f16, bf16)
    tbi, sg, hk = _unit_coords(np.int64(u), n_tb, n_sub)
    t0 = tbi * tb
    t1 = min(t0 + tb, n_tokens)
    nq = (t1 - t0) * hpg  # query qi = token t0 + qi // hpg, head h0 + qi % hpg
    h0 = hk * gq + sg * hpg
    st = tok_stream[t0]
    dkp = (dk + LANES - 1) // LANES * LANES  # head size padded with zero components (load_tile)
    qb = np.zeros((nq, dkp), dtype=np.float32)
    for qi in range(nq):
        for e in range(dk):
            qb[qi, e] = q[t0 + qi // hpg, h0 + qi % hpg, e]
    kt = np.zeros((KT, dkp), dtype=np.float32)  # columns from dk on stay 0
    mt = np.empty((t1 - t0, KT), dtype=np.float32)
    p = np.empty(nq * n_kvp, dtype=np.float32)  # [nq, n_kvp] scores, then probabilities
    tmax = np.full((nq, n_tiles), NEG_INF, dtype=np.float32)  # per tile max score; -inf: not visible
    for ti in range(n_tiles):
        j0 = ti * KT
        nj = min(KT, n_kv - j0)
        if not tile_live(mask, t0, t1, j0, j0 + nj):
            continue
        load_tile(type_k, k, st, j0, nj, hk * kb, kb, kt)
        mask_tile(mask, t0, t1, j0, nj, mt)
        qi = 0
        while qi + 4 <= nq:
            tile_dots4(qb, qi, kt, p, qi * n_kvp + j0, n_kvp)
            qi += 4
        while qi < nq:
            tile_dots1(qb, qi, kt, p, qi * n_kvp + j0, n_kvp)
            qi += 1
        for qi in range(nq):
            tmax[qi, ti] = tile_scores(p, qi * n_kvp + j0, mt, qi // hpg, scale, softcap)
    has_sinks = sinks.shape[0] > 0
    for qi in range(nq):  # masked softmax per query row
        m = NEG_INF
        for ti in range(n_tiles):
            m = max(m, tmax[qi, ti])
        if has_sinks:
            m = max(m, sinks[h0 + qi % hpg])
        # gsum (KVCHAT_GGML_ORDER=1): ggml_soft_max_f32's form, each 16 cells' exps (ggml_v_expf) in
        # one tree, the trees summed in double; else libm expf, lane l sums cells l, l + 16, ... in
        # order, then one tree (insensitive to where a sliding window's cells sit in its ring)
        s = np.float64(0.0)
        sv = vzero()
        s0 = start[t0 + qi // hpg] // KT
        for i in range(n_tiles):
            ti = (s0 + i) % n_tiles
            if tmax[qi, ti] != NEG_INF:
                o = qi * n_kvp + ti * KT
                if gsum:  # ggml_v_expf of this CPU on vectors (masked cells: exp(-inf) = 0)
                    vm = vbcast(m)
                    for h in range(0, KT, LANES):
                        vstore(p, o + h, vexpf_ggml(vsub(vload(p, o + h), vm)))
                else:  # libm expf
                    for j in range(KT):
                        p[o + j] = np.float32(math.exp(p[o + j] - m))
                if gsum:
                    s += np.float64(vhsum(vload(p, o)))
                    s += np.float64(vhsum(vload(p, o + LANES)))
                else:
                    sv = vadd(vadd(sv, vload(p, o)), vload(p, o + LANES))
        if not gsum:
            s = np.float64(vhsum(sv))
        if has_sinks:
            s += np.float64(np.float32(math.exp(sinks[h0 + qi % hpg] - m)))
        if gsum:  # 1 / sum in double, then f32
            inv = vbcast(np.float32(1.0 / s) if s > 0.0 else np.float32(0.0))
        else:
            inv = vbcast(np.float32(1.0) / np.float32(s) if s > 0.0 else np.float32(0.0))
        for ti in range(n_tiles):
            if tmax[qi, ti] != NEG_INF:
                o = qi * n_kvp + ti * KT
                for h in range(0, KT, LANES):  # p = e * inv, then in V's dot type (f16 / bf16)
                    x = vmul(vload(p, o + h), inv)
                    if type_v == _F16:
                        x = vround_f16(x)
                    elif type_v == _BF16:
                        x = vround_bf16(x)
                    vstore(p, o + h, x)
    vrow = np.zeros(n_kvp, dtype=np.float32)  # one row of V^T: component c of every cell
    for c in range(dv):
        dequant_cache_row(type_v, vt[st, hk * dv + c, 0 : n_kv * eb], vrow[:n_kv])
        for qi in range(nq):
            x = vzero()  # lane l: fma chain over cells l, l+16, ... of the visible tiles, in order
            s0 = start[t0 + qi // hpg] // KT
            for i in range(n_tiles):
                ti = (s0 + i) % n_tiles
                if tmax[qi, ti] != NEG_INF:
                    o = qi * n_kvp + ti * KT
                    x = vfma(vload(p, o), vload(vrow, ti * KT), x)
                    x = vfma(vload(p, o + LANES), vload(vrow, ti * KT + LANES), x)
            out[t0 + qi // hpg, h0 + qi % hpg, c] = vhsum(x)


def classic_n_units(q, n_head_kv, tb, hpg):
    n_tokens, n_head = q.shape[0], q.shape[1]
    return n_head_kv * ((n_head // n_head_kv) // hpg) * ((n_tokens + tb - 1) // tb)


@njit(cache=True, parallel=True)
def classic_attn_par(
    q, k, type_k, vt, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, hpg, n_units, gsum, out
):
    for u in prange(n_units):
        _classic_unit(
            u, q, k, type_k, vt, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, hpg, gsum, out
        )


@njit(cache=True)
def classic_attn_ser(
    q, k, type_k, vt, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, hpg, n_units, gsum, out
):
    for u in range(n_units):
        _classic_unit(
            u, q, k, type_k, vt, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, hpg, gsum, out
        )


def classic_plan(n_tokens, n_head, n_head_kv, n_stream, n_threads=2):
    """Classic path: choose (token block, heads per unit): share tiles across tokens and GQA heads,
    yet keep at least a few units per thread (n_threads 1: serial, maximal sharing)."""
    gq = n_head // n_head_kv
    tb = 1 if n_stream > 1 else min(32, max(1, n_tokens))
    n_tb = -(-n_tokens // tb)
    hpg = gq
    while n_threads > 1 and hpg > 1 and n_head_kv * (gq // hpg) * n_tb < 2 * n_threads:
        hpg -= 1
        while gq % hpg:
            hpg -= 1
    return tb, hpg
