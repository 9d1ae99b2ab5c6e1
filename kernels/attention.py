"""Attention over the KV cache, reading K and V rows in their cache format (never a float copy).

Two paths, as llama.cpp's build_attn_mha:
- flash (``flash_attn_ext``): online softmax over K/V tiles; V rows are ``[n_kv, n_embd_v_gqa]``.
- classic (flash off): KQ for all cells, masked softmax, then KQV against the transposed V cache
  ``[n_embd_v_gqa, kv_size]`` (f32/f16/bf16 elements only, like llama.cpp).

Work split (one parallel launch per layer): a unit is (kv head, group of its query heads, block
of tokens). Each unit dequantizes a tile of KT cache rows of its kv head once, into a small f32
buffer, and reuses it for every query of the unit — GQA heads and a block of prompt tokens —
so dequantization is amortized in prefill and parallel in decode. Tiles that the mask hides
for every token of the block are skipped (causal prefill touches only the lower triangle).

Numerics: ggml's one-row CPU kernel first rounds Q to the vec-dot type of K (f16 for f16 K,
8-bit blocks for quantized K); its tiled prompt kernel does not. ``round_q=True`` emulates the
former, but it is off by default: the rounding is a step function that turns the 1e-7
differences between batched and one-token matmuls into 5e-4 jumps, and it did not bring the
logits measurably closer to llama.cpp's (docs/performance.md).
The -inf mask needs IEEE infinities: these kernels use fastmath flags without ``ninf``/``nnan``.
"""
import math

import numpy as np
from numba import njit, prange

from kernels.ggml_types import GGMLType, type_info
from kernels.quants_fp import bits_to_f32, f32_to_bits
from kernels.quants import (
    dequant_row_bf16,
    dequant_row_f32,
    dequant_row_iq4_nl,
    dequant_row_q4_0,
    dequant_row_q4_1,
    dequant_row_q5_0,
    dequant_row_q5_1,
    dequant_row_q8_0,
    dequantize,
    quantize,
)

_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}  # fast math, but keep inf/nan semantics
KT = 32  # cache rows per tile
# below this many multiply-adds of K·Q a parallel launch costs more than it saves (a generated
# token at a few hundred cells of context runs serially; long contexts and prompts in parallel)
PARALLEL_MIN_WORK = 1 << 20
CHUNK_MIN = 256  # fewest cells per chunk when a generated token's cells are split across threads

_F32, _F16, _BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
_Q4_0, _Q4_1, _Q5_0 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0)
_Q5_1, _Q8_0, _IQ4_NL = int(GGMLType.Q5_1), int(GGMLType.Q8_0), int(GGMLType.IQ4_NL)
CACHE_TYPES = (_F32, _F16, _BF16, _Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _IQ4_NL)


@njit(cache=True, fastmath=True)
def _f16_row_fast(src, dst):
    """f16 bytes -> f32, branch-free so LLVM vectorizes it (the K/V hot loop of f16 caches).
    Exact for every half: the 15 magnitude bits shifted into a float and scaled by 2^112 give
    normals and subnormals alike; exponent 31 (inf/NaN) is patched by a select."""
    for i in range(dst.shape[0]):
        h = np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))
        mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
        f = bits_to_f32(mag) * np.float32(5.192296858534828e33)  # 2^112
        fb = f32_to_bits(f)
        fb = (np.uint32(0x7F800000) | mag) if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) else fb
        dst[i] = bits_to_f32(fb | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True)
def dequant_cache_row(t, src, dst):
    """Dequantize one cache row fragment src (u8) of format t into dst (f32).
    Only the cache formats are dispatched (smaller than quants.dequant_row_any: shorter compile)."""
    if t == _F16:
        _f16_row_fast(src, dst)
    elif t == _Q8_0:
        dequant_row_q8_0(src, dst)
    elif t == _Q4_0:
        dequant_row_q4_0(src, dst)
    elif t == _F32:
        dequant_row_f32(src, dst)
    elif t == _BF16:
        dequant_row_bf16(src, dst)
    elif t == _Q4_1:
        dequant_row_q4_1(src, dst)
    elif t == _Q5_0:
        dequant_row_q5_0(src, dst)
    elif t == _Q5_1:
        dequant_row_q5_1(src, dst)
    elif t == _IQ4_NL:
        dequant_row_iq4_nl(src, dst)


@njit(cache=True, fastmath=_FM)
def _tile_live(mask, t0, t1, j0, j1):
    """True if any token of [t0, t1) may see any cell of [j0, j1)."""
    for t in range(t0, t1):
        for j in range(j0, j1):
            if mask[t, j] != -np.inf:
                return True
    return False


@njit(cache=True, fastmath=_FM, inline="always")
def _unit_coords(u, n_tb, n_sub):
    """Unit index -> (token block, head sub-group, kv head). Token blocks are visited in a
    zig-zag so that the contiguous ranges numba hands each thread get light and heavy
    (late, long-context) causal blocks alike."""
    i = u % n_tb
    tbi = i // 2 if i % 2 == 0 else n_tb - 1 - i // 2
    rest = u // n_tb
    return tbi, rest % n_sub, rest // n_sub


@njit(cache=True, fastmath=_FM, inline="always")
def _score(q, t, h, kt, j, dk, scale, softcap, mv):
    """scale * q[t,h]·k[j] (optionally soft-capped) plus the mask value."""
    d = np.float32(0.0)
    for c in range(dk):
        d += q[t, h, c] * kt[j, c]
    if softcap != 0.0:
        d = softcap * np.float32(math.tanh(d * (scale / softcap)))
    else:
        d = d * scale
    return d + mv


@njit(cache=True, fastmath={"nsz", "arcp", "contract", "afn"})
def _exp_le0(x):
    """exp(x) for x <= 0 (or -inf -> 0), branch-free so that loops over a tile vectorize (numba has
    no vector exp here). Cody-Waite reduction x = n*ln2 + r, a degree-6 polynomial on |r| <= ln2/2
    (about 1 ulp); no reassoc flag so the two-part reduction is kept as written."""
    xc = max(x, np.float32(-87.0))
    n = np.float32(math.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5)))
    r = xc - n * np.float32(0.693359375)
    r = r + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r) + np.float32(1.0)
    y = y * bits_to_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return y if x > np.float32(-87.0) else np.float32(0.0)


@njit(cache=True, fastmath=_FM, inline="always")
def _f16_bits(h):
    """f16 bit pattern (u32) -> f32, exact and branch-free (see _f16_row_fast)."""
    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
    fb = f32_to_bits(bits_to_f32(mag) * np.float32(5.192296858534828e33))  # 2^112
    fb = (np.uint32(0x7F800000) | mag) if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) else fb
    return bits_to_f32(fb | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True, fastmath=True)
def _dots(qb, qi, kt, nj, sc):
    """sc[j] = qb[qi]·kt[j] for j < nj. Finite inputs only: full fastmath lets LLVM vectorize the
    reduction (with the inf-safe flags it stays scalar, 10x slower)."""
    for j in range(nj):
        d = np.float32(0.0)
        for e in range(kt.shape[1]):
            d += qb[qi, e] * kt[j, e]
        sc[j] = d


@njit(cache=True, fastmath=True)
def _sum(x, n):
    """Sum of the finite values x[:n] (vectorized, see _dots)."""
    s = np.float32(0.0)
    for i in range(n):
        s += x[i]
    return s


@njit(cache=True, fastmath=_FM, inline="always")
def _load_tile(t, raw, st, j0, nj, b0, nb, dst):
    """Dequantize bytes [b0, b0+nb) of cache rows j0..j0+nj of stream st into dst[:nj] (f32 [KT, d]).
    f16 and q8_0 (the usual caches) are decoded inline with plain 3-D indexing, which LLVM
    vectorizes (a per-row slice costs more than the 64 values it holds); other formats per row."""
    d = dst.shape[1]
    if t == _F16:
        r16 = raw.view(np.uint16)  # [n_stream, n_kv, row_bytes / 2] f16 bits (rows are even)
        o = b0 // 2
        for j in range(nj):
            for i in range(d):
                dst[j, i] = _f16_bits(np.uint32(r16[st, j0 + j, o + i]))
    elif t == _Q8_0:
        for j in range(nj):
            for b in range(d // 32):
                o = b0 + b * 34  # block: f16 scale, 32 int8
                sc = _f16_bits(np.uint32(raw[st, j0 + j, o]) | (np.uint32(raw[st, j0 + j, o + 1]) << np.uint32(8)))
                for i in range(32):
                    dst[j, b * 32 + i] = np.float32(np.int8(raw[st, j0 + j, o + 2 + i])) * sc
    else:
        tmp = np.empty(d, dtype=np.float32)  # [d] one row (dst itself is never handed to a call)
        for j in range(nj):
            dequant_cache_row(t, raw[st, j0 + j, b0:b0 + nb], tmp)
            for i in range(d):
                dst[j, i] = tmp[i]


@njit(cache=True, fastmath=_FM, inline="always")
def _flash_unit(u, q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, n_ch, cs,
                pm, ps, pacc):
    """One work unit of the flash path: (kv head, token block, chunk of cells). Every query head of
    the kv head's group and every token of the block is computed against each dequantized tile,
    so a K/V row is decoded once per unit. Writes the chunk's partial online softmax — running max
    pm, sum ps and unnormalized sum of p*v pacc — for the merge (see _merge_partials)."""
    n_tokens, n_head, dk = q.shape
    dv = pacc.shape[3]
    n_kv = mask.shape[1]
    gq = n_head // n_head_kv
    n_tb = (n_tokens + tb - 1) // tb
    kb = k.shape[2] // n_head_kv  # bytes of one kv head in a K row
    vb = v.shape[2] // n_head_kv
    c = u % n_ch
    rest = u // n_ch
    i = rest % n_tb  # token blocks in zig-zag: each thread's range gets light and heavy causal blocks
    tbi = i // 2 if i % 2 == 0 else n_tb - 1 - i // 2
    hk = rest // n_tb
    t0 = tbi * tb
    t1 = min(t0 + tb, n_tokens)
    h0 = hk * gq
    nq = (t1 - t0) * gq  # queries of the unit: query qi = token t0 + qi // gq, head h0 + qi % gq
    st = tok_stream[t0]
    qb = np.empty((nq, dk), dtype=np.float32)  # the unit's queries, contiguous
    for qi in range(nq):
        for e in range(dk):
            qb[qi, e] = q[t0 + qi // gq, h0 + qi % gq, e]
    kt = np.empty((KT, dk), dtype=np.float32)  # dequantized K tile
    vt = np.empty((KT, dv), dtype=np.float32)  # dequantized V tile
    sc = np.empty(KT, dtype=np.float32)  # scores, then probabilities, of one query against the tile
    acc = np.zeros((nq, dv), dtype=np.float32)  # running sum of p * v
    mx = np.full(nq, -np.inf, dtype=np.float32)  # running max score
    sm = np.zeros(nq, dtype=np.float32)  # running sum of p
    for j0 in range(c * cs, min((c + 1) * cs, n_kv), KT):
        nj = min(KT, n_kv - j0)
        if not _tile_live(mask, t0, t1, j0, j0 + nj):
            continue
        _load_tile(type_k, k, st, j0, nj, hk * kb, kb, kt)
        _load_tile(type_v, v, st, j0, nj, hk * vb, vb, vt)
        for qi in range(nq):
            t = t0 + qi // gq
            _dots(qb, qi, kt, nj, sc)
            m_tile = np.float32(-np.inf)
            for j in range(nj):
                d = sc[j]
                if softcap != 0.0:
                    d = softcap * np.float32(math.tanh(d * (scale / softcap)))
                else:
                    d = d * scale
                s = d + mask[t, j0 + j]
                sc[j] = s
                m_tile = max(m_tile, s)
            if m_tile == -np.inf:
                continue
            if m_tile > mx[qi]:
                r = _exp_le0(mx[qi] - m_tile)  # 0 when the old max is -inf
                sm[qi] *= r
                for e in range(dv):
                    acc[qi, e] *= r
                mx[qi] = m_tile
            m_new = mx[qi]
            for j in range(nj):
                sc[j] = _exp_le0(sc[j] - m_new)
            sm[qi] += _sum(sc, nj)
            for j in range(nj):
                p = sc[j]
                if p != 0.0:
                    for e in range(dv):
                        acc[qi, e] += p * vt[j, e]
    for qi in range(nq):
        t = t0 + qi // gq
        h = h0 + qi % gq
        pm[c, t, h] = mx[qi]
        ps[c, t, h] = sm[qi]
        for e in range(dv):
            pacc[c, t, h, e] = acc[qi, e]


@njit(cache=True, fastmath=_FM)
def _merge_partials(pm, ps, pacc, out):
    """Combine the chunks' partial softmaxes: out = sum_c e^(m_c-M) acc_c / sum_c e^(m_c-M) s_c with
    M = max_c m_c. A query that sees no cell at all gets zeros (as ggml)."""
    n_ch, n_tokens, n_head, dv = pacc.shape
    for t in range(n_tokens):
        for h in range(n_head):
            m = np.float32(-np.inf)
            for c in range(n_ch):
                m = max(m, pm[c, t, h])
            for e in range(dv):
                out[t, h, e] = 0.0
            if m == -np.inf:
                continue
            s = np.float32(0.0)
            for c in range(n_ch):
                if pm[c, t, h] == -np.inf:
                    continue
                w = _exp_le0(pm[c, t, h] - m)
                s += w * ps[c, t, h]
                for e in range(dv):
                    out[t, h, e] += w * pacc[c, t, h, e]
            inv = np.float32(1.0) / s
            for e in range(dv):
                out[t, h, e] *= inv


@njit(cache=True, fastmath=_FM, inline="always")
def _classic_unit(u, q, k, type_k, vt, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, hpg, out):
    """One work unit of the classic path: V is transposed, vt [n_stream, n_embd_v_gqa, >= n_kv * elem]
    u8. KQ for all cells -> masked softmax -> out[d] = sum_j p_j * V^T[d, j]."""
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    n_kv = mask.shape[1]
    gq = n_head // n_head_kv
    n_sub = gq // hpg
    n_tb = (n_tokens + tb - 1) // tb
    kb = k.shape[2] // n_head_kv
    eb = 4 if type_v == _F32 else 2  # bytes per V element (f32, f16, bf16)
    tbi, sg, hk = _unit_coords(u, n_tb, n_sub)
    t0 = tbi * tb
    t1 = min(t0 + tb, n_tokens)
    nq = (t1 - t0) * hpg
    h0 = hk * gq + sg * hpg
    st = tok_stream[t0]
    kt = np.empty((KT, dk), dtype=np.float32)
    p = np.full((nq, n_kv), -np.inf, dtype=np.float32)  # scores, then probabilities
    for j0 in range(0, n_kv, KT):
        j1 = min(j0 + KT, n_kv)
        if not _tile_live(mask, t0, t1, j0, j1):
            continue
        for j in range(j1 - j0):
            dequant_cache_row(type_k, k[st, j0 + j, hk * kb:(hk + 1) * kb], kt[j])
        for t in range(t0, t1):
            for hi in range(hpg):
                qi = (t - t0) * hpg + hi
                for j in range(j1 - j0):
                    mv = mask[t, j0 + j]
                    if mv != -np.inf:
                        p[qi, j0 + j] = _score(q, t, h0 + hi, kt, j, dk, scale, softcap, mv)
    for qi in range(nq):  # masked softmax per query row
        m = np.float32(-np.inf)
        for j in range(n_kv):
            if p[qi, j] > m:
                m = p[qi, j]
        s = np.float32(0.0)
        for j in range(n_kv):
            e = np.float32(0.0) if p[qi, j] == -np.inf else np.float32(math.exp(p[qi, j] - m))
            p[qi, j] = e
            s += e
        inv = np.float32(1.0 / s) if s > 0.0 else np.float32(0.0)
        for j in range(n_kv):
            p[qi, j] *= inv
    vrow = np.empty(n_kv, dtype=np.float32)  # one row of V^T: component c of every cell
    for c in range(dv):
        dequant_cache_row(type_v, vt[st, hk * dv + c, 0:n_kv * eb], vrow)
        for t in range(t0, t1):
            for hi in range(hpg):
                qi = (t - t0) * hpg + hi
                a = np.float32(0.0)
                for j in range(n_kv):
                    a += p[qi, j] * vrow[j]
                out[t, h0 + hi, c] = a


def _n_units(q, n_head_kv, tb, hpg):
    n_tokens, n_head = q.shape[0], q.shape[1]
    return n_head_kv * ((n_head // n_head_kv) // hpg) * ((n_tokens + tb - 1) // tb)


@njit(cache=True, fastmath=_FM, parallel=True)
def _flash_attn_par(q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, n_ch, cs, out):
    """q: [n_tokens, n_head, dk] f32; k: [n_stream, >=n_kv, row_k] u8; v: [n_stream, >=n_kv, row_v] u8;
    mask: [n_tokens, n_kv] f32 (0 / -inf); tok_stream: [n_tokens] i32; out: [n_tokens, n_head, dv] f32.
    One parallel launch over (kv head, token block, chunk of cs cells) units, then the serial merge."""
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    pm = np.empty((n_ch, n_tokens, n_head), dtype=np.float32)  # running max per chunk
    ps = np.empty((n_ch, n_tokens, n_head), dtype=np.float32)  # sum of p per chunk
    pacc = np.empty((n_ch, n_tokens, n_head, dv), dtype=np.float32)  # sum of p * v per chunk
    n_units = n_head_kv * ((n_tokens + tb - 1) // tb) * n_ch
    for u in prange(n_units):
        _flash_unit(u, q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, n_ch, cs,
                    pm, ps, pacc)
    _merge_partials(pm, ps, pacc, out)


@njit(cache=True, fastmath=_FM)
def _flash_attn_ser(q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, n_ch, cs, out):
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    pm = np.empty((n_ch, n_tokens, n_head), dtype=np.float32)
    ps = np.empty((n_ch, n_tokens, n_head), dtype=np.float32)
    pacc = np.empty((n_ch, n_tokens, n_head, dv), dtype=np.float32)
    n_units = n_head_kv * ((n_tokens + tb - 1) // tb) * n_ch
    for u in range(n_units):
        _flash_unit(u, q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, n_ch, cs,
                    pm, ps, pacc)
    _merge_partials(pm, ps, pacc, out)


@njit(cache=True, fastmath=_FM, parallel=True)
def _classic_attn_par(q, k, type_k, vt, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, hpg, n_units, out):
    for u in prange(n_units):
        _classic_unit(u, q, k, type_k, vt, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, hpg, out)


@njit(cache=True, fastmath=_FM)
def _classic_attn_ser(q, k, type_k, vt, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, hpg, n_units, out):
    for u in range(n_units):
        _classic_unit(u, q, k, type_k, vt, type_v, mask, tok_stream, n_head_kv, scale, softcap, tb, hpg, out)


def round_q_like_ggml(q, type_k):
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
    flat = q.reshape(-1, q.shape[-1])  # [n_tokens * n_head, dk]; dk is a multiple of 32
    return dequantize(quantize(flat, _Q8_0), _Q8_0, q.shape[-1]).reshape(q.shape)


def _split(n_tokens, n_head, n_head_kv, n_stream, n_threads=2):
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


def flash_split(n_tokens, n_head_kv, n_kv, n_stream, n_threads=2, chunk_min=None):
    """Flash path work split -> (token block, number of cell chunks, chunk size in cells).

    A unit is (kv head, token block, chunk). Prompts have many token blocks and need no chunks;
    a generated token has only n_head_kv units, so the cells are cut into chunks (flash-decoding)
    until every thread has a few units and their count is a multiple of the thread count —
    each chunk at least chunk_min cells, so the merge stays negligible."""
    chunk_min = CHUNK_MIN if chunk_min is None else chunk_min
    tb = 1 if n_stream > 1 else min(32, max(1, n_tokens))
    base = n_head_kv * -(-n_tokens // tb)
    n_ch = 1
    if n_threads > 1 and base < 4 * n_threads:
        n_ch = -(-4 * n_threads // base)
        while (base * n_ch) % n_threads:
            n_ch += 1
        n_ch = max(1, min(n_ch, n_kv // chunk_min))
    cs = -(-(-(-n_kv // n_ch)) // KT) * KT  # cells per chunk, whole tiles
    return tb, max(1, -(-n_kv // cs)), cs


def attention(q, k, type_k, v, type_v, mask, tok_stream, n_head_kv, scale, softcap=0.0,
              flash=True, n_threads=2, round_q=False):
    """Attention of fresh queries over the cache.

    q: [n_tokens, n_head, dk] f32; k: (u8 [n_stream, n_kv, row_k], type_k) cache view;
    v: flash -> u8 [n_stream, n_kv, row_v]; classic -> transposed u8 [n_stream, n_embd_v_gqa, kv_size*elem];
    mask: [n_tokens, n_kv] f32 (0 / -inf); tok_stream: [n_tokens] i32.
    Returns [n_tokens, n_head * dv] f32 (heads concatenated, ready for the output projection).
    """
    n_tokens, n_head, dk = q.shape
    n_kv = mask.shape[1]
    if flash:
        dv = _values_per_bytes(int(type_v), v.shape[2] // n_head_kv)
    else:
        dv = v.shape[1] // n_head_kv
    qr = round_q_like_ggml(q, int(type_k)) if round_q else q
    qr = np.ascontiguousarray(qr, dtype=np.float32)
    out = np.empty((n_tokens, n_head, dv), dtype=np.float32)
    par = n_threads > 1 and n_tokens * n_head * n_kv * dk >= PARALLEL_MIN_WORK
    mask = np.ascontiguousarray(mask, dtype=np.float32)
    ts = np.ascontiguousarray(tok_stream, dtype=np.int32)
    args = (qr, k, int(type_k), v, int(type_v), mask, ts, int(n_head_kv), np.float32(scale), np.float32(softcap))
    if flash:
        tb, n_ch, cs = flash_split(n_tokens, n_head_kv, n_kv, k.shape[0], n_threads if par else 1)
        fn = _flash_attn_par if par else _flash_attn_ser
        fn(*args, int(tb), int(n_ch), int(cs), out)
    else:
        tb, hpg = _split(n_tokens, n_head, n_head_kv, k.shape[0], n_threads if par else 1)
        fn = _classic_attn_par if par else _classic_attn_ser
        fn(*args, int(tb), int(hpg), int(_n_units(q, n_head_kv, tb, hpg)), out)
    return out.reshape(n_tokens, n_head * dv)


def _values_per_bytes(t, nbytes):
    """How many values nbytes of format t hold."""
    ti = type_info(t)
    return nbytes // ti.type_size * ti.block_size
