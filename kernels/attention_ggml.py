"""Flash attention in the float order of ggml-cpu's tiled flash attention (opt-in:
KVCHAT_GGML_ORDER=1, with the q4_1 order of kernels/matmul_lanes.py; f16 or f32 K and V of one
type, no sinks; kernels/attention.py dispatches).

ggml's `ggml_compute_forward_flash_attn_ext_tiled` (ops.cpp; the path llama.cpp's CPU flash
attention takes for ubatches of >= 64 queries with f16/f32 K/V, so the one perplexity runs) per
query row, over 64-cell tiles from cell 0:
- score = one fma chain over the head's components in order from 0 (simd_gemm, Q in f32), times
  the scale (soft-capped: scale / cap, tanh, times cap), plus the mask; cells past n_kv -inf;
- a tile whose scores are all -inf is skipped; else M' = max(M, tile max), and where M' > M the
  accumulator and the sum S are multiplied by libm expf(M - M');
- p = ggml_v_expf(score - M') (this CPU's form, kernels/ggml_math), S = f32(S + the tile's
  16-cell trees summed in double) (ggml_vec_soft_max_f32, AVX-512 form);
- acc[e] = one fma chain over the tile's cells in order (simd_gemm), carried across tiles;
- out = acc * (1.0f / S).
So a row depends on its own query, mask and cells only (batch-invariant by construction), but the
walk over the cells is one sequential online softmax: no flash-decoding split, one unit per kv
head and token block. Below 64 queries llama.cpp runs another arithmetic (Q rounded to f16, V
summed in f16), so a generated token's row is not llama.cpp's; a prompt's is, bit for bit
(tests/test_attention.py against tests/helpers/ggml_order.flash_tiled_reference).

Vectorized in that order: a tile's K is widened and transposed (16 x 16 blocks by shuffles,
kernels/simd.vtranspose16_f16) to [component, cell], so 16 cells' scores are one vector fma
chain over the components (4 chains a tile); mask, max, ggml_v_expf (kernels/ggml_math.vexpf_ggml,
the scalar's bits lane by lane) and the 16-cell trees on vectors; P.V as 4 chains of vector fmas
over the cells, each lane one component's chain in cell order.
"""

import math

import numpy as np
from numba import njit, prange

from kvchat.kernels.attention_tiles import NEG_INF, dequant_cache_row
from kvchat.kernels.ggml_math import vexpf_ggml
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.simd import (
    LANES,
    vadd,
    vbcast,
    vfma,
    vhmax,
    vhsum,
    vload,
    vload_f16_at,
    vmax,
    vmul,
    vstore,
    vsub,
    vtranspose16,
    vtranspose16_f16,
    vzero,
)

TILE = 64  # GGML_FA_TILE_KV
_F16 = int(GGMLType.F16)
_NV = TILE // LANES  # score vectors per tile


@njit(cache=True, inline="always")
def _ggml_unit(u, q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, tb, hpu, out):
    """Rows of token block u % n_tb, heads hpu * sg .. of the group of kv head hk (sg, hk =
    (u // n_tb) % (gq / hpu), (u // n_tb) // (gq / hpu)): q [n_tokens, n_head, dk] f32, k / v
    u8 [n_stream, n_kv, row bytes] cache rows (f16 or f32), mask [n_tokens, n_kv] f32, start
    [n_tokens] i64 (each row walks its tiles from the one holding its start cell, cyclically),
    out [n_tokens, n_head, dv] f32."""
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    n_kv = mask.shape[1]
    gq = n_head // n_head_kv
    n_tb = (n_tokens + tb - 1) // tb
    n_sub = gq // hpu
    tbi, sg, hk = u % n_tb, (u // n_tb) % n_sub, (u // n_tb) // n_sub
    h0 = hk * gq + sg * hpu  # the unit's first head
    t0 = tbi * tb
    t1 = min(t0 + tb, n_tokens)
    kb, vb = k.shape[2] // n_head_kv, v.shape[2] // n_head_kv
    dkp = (dk + LANES - 1) // LANES * LANES
    dvp = (dv + LANES - 1) // LANES * LANES
    n_tiles = (n_kv + TILE - 1) // TILE
    kr = np.zeros((TILE, dkp), dtype=np.float32)  # K tile, a cell a row (components past dk zero)
    kt = np.zeros((dkp, TILE), dtype=np.float32)  # K tile transposed: component e of every cell
    vt = np.zeros((TILE, dvp), dtype=np.float32)  # V tile, components past dv zero
    sc = np.empty(TILE, dtype=np.float32)
    cap = softcap != 0.0
    sc_scale = scale / softcap if cap else scale
    vscale = vbcast(sc_scale)
    f16_fast = type_k == _F16 and type_v == _F16 and dk % LANES == 0 and dv % LANES == 0
    ta = t0
    while ta < t1:  # runs of tokens of one stream that start their walk in the same tile share its decode
        s0 = start[ta] // TILE
        tz = ta + 1
        while tz < t1 and start[tz] // TILE == s0 and tok_stream[tz] == tok_stream[ta]:
            tz += 1
        nq = (tz - ta) * hpu  # row qi: token ta + qi // hpu, head h0 + qi % hpu
        st = tok_stream[ta]
        acc = np.zeros((nq, dvp), dtype=np.float32)
        ss = np.empty(nq * TILE, dtype=np.float32)  # the run's rows' raw scores of a tile
        m_run = np.full(nq, NEG_INF, dtype=np.float32)
        s_run = np.zeros(nq, dtype=np.float32)
        for i in range(n_tiles):
            ti = (s0 + i) % n_tiles
            j0 = ti * TILE
            nj = min(TILE, n_kv - j0)
            live = False
            for t in range(ta, tz):
                for j in range(j0, j0 + nj):
                    if mask[t, j] != NEG_INF:
                        live = True
                        break
                if live:
                    break
            if not live:
                continue
            if f16_fast and nj == TILE:  # f16 rows widened straight into kt / vt (exact)
                kbase = st * k.strides[0] + j0 * k.strides[1] + hk * kb
                for c in range(_NV):
                    for e0 in range(0, dk, LANES):
                        kof = kbase + c * LANES * k.strides[1] + 2 * e0
                        vtranspose16_f16(k, kof, k.strides[1], kt, e0 * TILE + c * LANES, TILE)
                vbase = st * v.strides[0] + j0 * v.strides[1] + hk * vb
                for j in range(TILE):
                    for e in range(0, dv, LANES):
                        vstore(vt, j * dvp + e, vload_f16_at(v, vbase + j * v.strides[1] + 2 * e))
            else:
                for j in range(TILE):  # decode: the cache's values exactly, cells past nj zero
                    if j < nj:
                        dequant_cache_row(type_k, k[st, j0 + j, hk * kb : (hk + 1) * kb], kr[j, :dk])
                        dequant_cache_row(type_v, v[st, j0 + j, hk * vb : (hk + 1) * vb], vt[j, :dv])
                    else:
                        kr[j, :] = 0.0
                        vt[j, :] = 0.0
                for e0 in range(0, dkp, LANES):  # kt = kr transposed, 16 x 16 blocks by shuffles
                    for c in range(_NV):
                        vtranspose16(kr, c * LANES * dkp + e0, dkp, kt, e0 * TILE + c * LANES, TILE)
            full = nj == TILE and not cap
            qi = 0
            while qi < nq:  # scores of 64 cells: 4 vectors a row, each lane one fma chain over the
                t, h = ta + qi // hpu, h0 + qi % hpu  # components from 0; two rows at a time
                a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
                if qi + 1 < nq:
                    t2, h2 = ta + (qi + 1) // hpu, h0 + (qi + 1) % hpu
                    b0, b1, b2, b3 = vzero(), vzero(), vzero(), vzero()
                    for e in range(dk):
                        k0, k1, k2, k3 = (
                            vload(kt, e * TILE),
                            vload(kt, e * TILE + 16),
                            vload(kt, e * TILE + 32),
                            vload(kt, e * TILE + 48),
                        )
                        qe, qf = vbcast(q[t, h, e]), vbcast(q[t2, h2, e])
                        a0, a1, a2, a3 = vfma(qe, k0, a0), vfma(qe, k1, a1), vfma(qe, k2, a2), vfma(qe, k3, a3)
                        b0, b1, b2, b3 = vfma(qf, k0, b0), vfma(qf, k1, b1), vfma(qf, k2, b2), vfma(qf, k3, b3)
                    o = (qi + 1) * TILE
                    vstore(ss, o, b0)
                    vstore(ss, o + 16, b1)
                    vstore(ss, o + 32, b2)
                    vstore(ss, o + 48, b3)
                else:
                    for e in range(dk):
                        qe = vbcast(q[t, h, e])
                        a0 = vfma(qe, vload(kt, e * TILE), a0)
                        a1 = vfma(qe, vload(kt, e * TILE + 16), a1)
                        a2 = vfma(qe, vload(kt, e * TILE + 32), a2)
                        a3 = vfma(qe, vload(kt, e * TILE + 48), a3)
                o = qi * TILE
                vstore(ss, o, a0)
                vstore(ss, o + 16, a1)
                vstore(ss, o + 32, a2)
                vstore(ss, o + 48, a3)
                qi += 2
            for qi in range(nq):
                t = ta + qi // hpu
                h = h0 + qi % hpu
                o = qi * TILE
                a0, a1, a2, a3 = vload(ss, o), vload(ss, o + 16), vload(ss, o + 32), vload(ss, o + 48)
                a0, a1, a2, a3 = vmul(a0, vscale), vmul(a1, vscale), vmul(a2, vscale), vmul(a3, vscale)
                if full:  # + mask, lane by lane
                    mo = t * n_kv + j0
                    a0, a1 = vadd(a0, vload(mask, mo)), vadd(a1, vload(mask, mo + 16))
                    a2, a3 = vadd(a2, vload(mask, mo + 32)), vadd(a3, vload(mask, mo + 48))
                    tmax = vhmax(vmax(vmax(a0, a1), vmax(a2, a3)))
                else:
                    vstore(sc, 0, a0)
                    vstore(sc, 16, a1)
                    vstore(sc, 32, a2)
                    vstore(sc, 48, a3)
                    tmax = NEG_INF
                    for j in range(TILE):
                        x = sc[j]
                        if cap:
                            x = np.float32(math.tanh(x)) * softcap
                        x = x + mask[t, j0 + j] if j < nj else NEG_INF
                        sc[j] = x
                        tmax = max(tmax, x)
                    a0, a1, a2, a3 = vload(sc, 0), vload(sc, 16), vload(sc, 32), vload(sc, 48)
                if tmax == NEG_INF:
                    continue
                m_old = m_run[qi]
                m_new = max(m_old, tmax)
                if m_new > m_old:
                    ms = np.float32(math.exp(m_old - m_new))  # libm expf; 0 on the first tile
                    vms = vbcast(ms)
                    for e in range(0, dvp, LANES):
                        vstore(acc[qi], e, vmul(vload(acc[qi], e), vms))
                    s_run[qi] = s_run[qi] * ms
                m_run[qi] = m_new
                vm = vbcast(m_new)
                p0, p1 = vexpf_ggml(vsub(a0, vm)), vexpf_ggml(vsub(a1, vm))
                p2, p3 = vexpf_ggml(vsub(a2, vm)), vexpf_ggml(vsub(a3, vm))
                sd = np.float64(vhsum(p0)) + np.float64(vhsum(p1))
                sd = sd + np.float64(vhsum(p2))
                sd = sd + np.float64(vhsum(p3))
                s_run[qi] = np.float32(np.float64(s_run[qi]) + sd)
                vstore(sc, 0, p0)
                vstore(sc, 16, p1)
                vstore(sc, 32, p2)
                vstore(sc, 48, p3)
                e = 0
                while e + 8 * LANES <= dvp:  # 8 vectors at once (8 chains in flight)
                    x0, x1 = vload(acc[qi], e), vload(acc[qi], e + 16)
                    x2, x3 = vload(acc[qi], e + 32), vload(acc[qi], e + 48)
                    x4, x5 = vload(acc[qi], e + 64), vload(acc[qi], e + 80)
                    x6, x7 = vload(acc[qi], e + 96), vload(acc[qi], e + 112)
                    for j in range(TILE):
                        pj = vbcast(sc[j])
                        o = j * dvp + e
                        x0, x1 = vfma(vload(vt, o), pj, x0), vfma(vload(vt, o + 16), pj, x1)
                        x2, x3 = vfma(vload(vt, o + 32), pj, x2), vfma(vload(vt, o + 48), pj, x3)
                        x4, x5 = vfma(vload(vt, o + 64), pj, x4), vfma(vload(vt, o + 80), pj, x5)
                        x6, x7 = vfma(vload(vt, o + 96), pj, x6), vfma(vload(vt, o + 112), pj, x7)
                    vstore(acc[qi], e, x0)
                    vstore(acc[qi], e + 16, x1)
                    vstore(acc[qi], e + 32, x2)
                    vstore(acc[qi], e + 48, x3)
                    vstore(acc[qi], e + 64, x4)
                    vstore(acc[qi], e + 80, x5)
                    vstore(acc[qi], e + 96, x6)
                    vstore(acc[qi], e + 112, x7)
                    e += 8 * LANES
                while e + 4 * LANES <= dvp:  # acc[e] += p_j * v_j[e], cells in order; 4 vectors at once
                    x0, x1 = vload(acc[qi], e), vload(acc[qi], e + 16)
                    x2, x3 = vload(acc[qi], e + 32), vload(acc[qi], e + 48)
                    for j in range(TILE):
                        pj = vbcast(sc[j])
                        o = j * dvp + e
                        x0 = vfma(vload(vt, o), pj, x0)
                        x1 = vfma(vload(vt, o + 16), pj, x1)
                        x2 = vfma(vload(vt, o + 32), pj, x2)
                        x3 = vfma(vload(vt, o + 48), pj, x3)
                    vstore(acc[qi], e, x0)
                    vstore(acc[qi], e + 16, x1)
                    vstore(acc[qi], e + 32, x2)
                    vstore(acc[qi], e + 48, x3)
                    e += 4 * LANES
                while e < dvp:
                    x = vload(acc[qi], e)
                    for j in range(TILE):
                        x = vfma(vload(vt, j * dvp + e), vbcast(sc[j]), x)
                    vstore(acc[qi], e, x)
                    e += LANES
        for qi in range(nq):
            inv = np.float32(0.0) if s_run[qi] == 0.0 else np.float32(1.0) / s_run[qi]
            t = ta + qi // hpu
            h = h0 + qi % hpu
            for e in range(dv):
                out[t, h, e] = acc[qi, e] * inv
        ta = tz


@njit(cache=True, parallel=True)
def ggml_flash_par(q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, tb, hpu, n_units, out):
    for u in prange(n_units):
        _ggml_unit(u, q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, tb, hpu, out)


@njit(cache=True)
def ggml_flash_ser(q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, tb, hpu, n_units, out):
    for u in range(n_units):
        _ggml_unit(u, q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, tb, hpu, out)


def ggml_flash_units(n_tokens, n_head, n_head_kv, n_threads):
    """(token block, heads per unit, units): blocks of up to 16 tokens, fewer while there are
    under two units a thread (each unit decodes a tile once for its rows); a kv head's query heads
    split over units (halved while they divide) while there are fewer units than threads (one
    token of a model with one kv head). Each row's arithmetic is the same in any unit."""
    tb = min(16, max(1, n_tokens))
    while tb > 1 and n_head_kv * -(-n_tokens // tb) < 2 * n_threads:
        tb //= 2
    gq = n_head // n_head_kv
    hpu = gq
    while hpu % 2 == 0 and n_head_kv * -(-n_tokens // tb) * (gq // hpu) < n_threads:
        hpu //= 2
    return tb, hpu, n_head_kv * -(-n_tokens // tb) * (gq // hpu)
