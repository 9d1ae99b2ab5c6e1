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
- classic: the softmax sum and each P·V component are 16 lane chains over the visible tiles.
Tiles and chunks that a query cannot see contribute nothing (skipped, or exact zeros).

Work split (one parallel launch per layer): a unit is (kv head, group of its query heads, block
of tokens[, chunk]). Each unit dequantizes a tile of KT cache rows of its kv head once, into a
small f32 buffer, and reuses it for every query of the unit — GQA heads and a block of prompt
tokens — so dequantization is amortized in prefill and parallel in decode. Tiles that the mask
hides for every token of the block are skipped (causal prefill touches only the lower triangle).

The flash path's hot loop is `_chunk` (per unit and chunk: K/V tiles decoded once, then each
query's scores and online-softmax step); the classic path is kernels/attention_classic.py; the
tile-level pieces (cache decode, scores, a tile's online-softmax step) are kernels/attention_tiles.py.

Numerics: ggml converts Q to K's vec-dot type before K·Q: 8-bit blocks for a quantized K and
bf16 for a bf16 K on every path, f16 for an f16 K only on its one-row path.
``round_q_to_vec_dot_type`` is that rounding; the forward applies it for quantized and bf16 K
(runtime/arch/blocks.py: round_q_like_ggml, which also says why f16 K is left in f32), so
``attention(round_q=...)`` stays False there (docs/performance.md has the perplexity effect).
"""

import numpy as np
from numba import njit, prange

from kvchat.kernels import parallel
from kvchat.kernels.attention_classic import classic_attn_par, classic_attn_ser, classic_n_units, classic_plan
from kvchat.kernels.attention_tiles import (
    KT,
    NEG_INF,
    exp_le0,
    load_tile,
    mask_tile,
    prefetch_tile,
    query_scores,
    softmax_step,
    tile_live,
    tile_pv,
    tile_pv1,
)
from kvchat.kernels.ggml_types import GGMLType, type_info
from kvchat.kernels.quants import dequantize, quantize
from kvchat.kernels.simd import LANES

_F32, _F16, _BF16, _Q8_0 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16), int(GGMLType.Q8_0)
PREFETCH = 2  # tiles ahead that _chunk asks the cache rows of
CHUNK = 256  # cells per flash chunk: a fixed multiple of KT, never derived from the call's shape


@njit(cache=True, inline="always")
def _chunk(
    qb,
    gq,
    t0,
    t1,
    mask,
    start,
    k,
    type_k,
    v,
    type_v,
    st,
    kb0,
    kb,
    vb0,
    vb,
    scale,
    softcap,
    j_lo,
    j_hi,
    kt,
    vt,
    sc,
    mt,
    tm,
    gs,
    gr,
    mx,
    sm,
    acc,
):
    """Online softmax of the unit's queries (qb [nq, dk]; query qi is token t0 + qi // gq) over
    the cells [j_lo, j_hi) of one chunk, from a fresh state: rows 0 .. nq - 1 of mx [2 nq] max
    score (-inf: no cell seen), sm [2 nq] sum of p = e^(s - mx), acc [2 nq, dv] sum of p * v.
    In a query's start chunk (the one holding the tile of start[token], see `attention`) the
    tiles before its start tile go to row nq + qi instead (fresh: set to -inf by the caller),
    folded last. kt [KT, dk] / vt [KT, dv] tiles, sc [nq * KT] scores then probabilities,
    mt [t1 - t0, KT] mask tile, tm [nq] tile maxima, gs / gr [4] a P·V group's sc offsets / rows.
    Per tile: every query's scores, then each query's softmax step, then the P·V of up to four
    queries at once (tile_pv: each query's chains as alone, so grouping never changes a bit)."""
    nq = qb.shape[0]
    n_kv = mask.shape[1]
    for qi in range(nq):
        mx[qi] = NEG_INF
    for j0 in range(j_lo, j_hi, KT):
        nj = min(KT, n_kv - j0)
        if not tile_live(mask, t0, t1, j0, j0 + nj):
            continue
        prefetch_tile(k, st, j0 + PREFETCH * KT, kb0, kb)
        prefetch_tile(v, st, j0 + PREFETCH * KT, vb0, vb)
        load_tile(type_k, k, st, j0, nj, kb0, kb, kt)
        load_tile(type_v, v, st, j0, nj, vb0, vb, vt)
        mask_tile(mask, t0, t1, j0, nj, mt)
        for qi in range(nq):
            tm[qi] = query_scores(qb, qi, kt, mt, qi // gq, scale, softcap, sc, qi * KT)
        n = 0
        for qi in range(nq):
            if tm[qi] == NEG_INF:
                continue
            s0 = start[t0 + qi // gq] // KT * KT  # the query's start tile
            r = nq + qi if j0 < s0 and s0 // CHUNK == j_lo // CHUNK else qi
            if softmax_step(r, tm[qi], sc, qi * KT, mx, sm, acc):
                tile_pv1(sc, qi * KT, vt, acc, r)  # some p = 0: those cells skipped
                continue
            gs[n] = qi * KT
            gr[n] = r
            n += 1
            if n == 4:
                tile_pv(4, sc, gs[0], gs[1], gs[2], gs[3], vt, acc, gr[0], gr[1], gr[2], gr[3])
                n = 0
        if n:
            tile_pv(n, sc, gs[0], gs[1], gs[2], gs[3], vt, acc, gr[0], gr[1], gr[2], gr[3])


@njit(cache=True, inline="always")
def _fold(m, s, a, m_c, s_c, acc_c):
    """Fold one chunk's partial softmax (m_c, s_c, acc_c [dv]) into a query's running result
    (m, s, a [dv], a updated in place); returns the new (m, s). Chunks are always folded in
    chunk order by this one function, so the result does not depend on who computed them."""
    if m_c == NEG_INF:
        return m, s
    if m == NEG_INF:
        for e in range(a.shape[0]):
            a[e] = acc_c[e]
        return m_c, s_c
    if m_c > m:
        r = exp_le0(m - m_c)
        for e in range(a.shape[0]):
            a[e] = a[e] * r + acc_c[e]
        return m_c, s * r + s_c
    w = exp_le0(m_c - m)
    for e in range(a.shape[0]):
        a[e] = a[e] + w * acc_c[e]
    return m, s + w * s_c


@njit(cache=True, inline="always")
def _finish(m, s, a, o):
    """o [dv] <- a / s; zeros for a query that saw no cell (as ggml)."""
    if m == NEG_INF:
        for e in range(o.shape[0]):
            o[e] = 0.0
        return
    inv = np.float32(1.0) / s
    for e in range(o.shape[0]):
        o[e] = a[e] * inv


@njit(cache=True, inline="always")
def _flash_unit(
    u,
    q,
    k,
    type_k,
    v,
    type_v,
    mask,
    start,
    tok_stream,
    n_head_kv,
    scale,
    softcap,
    tb,
    split,
    cpu,
    pm,
    ps,
    pacc,
    bm,
    bs,
    bacc,
    out,
):
    """One work unit of the flash path: (kv head, token block), or with split (kv head, token
    block, group of cpu chunks). Every query head of the kv head's group and every token of the
    block is computed against each dequantized tile, so a K/V row is decoded once per unit.
    Without split the unit folds all chunks, from the start chunk of its first token on
    (cyclically), then the part of the start chunk before the start tile, and writes out; with
    split it stores each chunk's partial softmax in pm/ps/pacc [n_ch, n_tokens, n_head(, dv)] and
    that last part in bm/bs/bacc [n_tokens, n_head(, dv)] for _merge_partials."""
    n_tokens, n_head, dk = q.shape
    dv = out.shape[2]
    n_kv = mask.shape[1]
    n_ch = (n_kv + CHUNK - 1) // CHUNK
    gq = n_head // n_head_kv
    n_tb = (n_tokens + tb - 1) // tb
    kb = k.shape[2] // n_head_kv  # bytes of one kv head in a K row
    vb = v.shape[2] // n_head_kv
    ui = np.int64(u)  # (a prange index may be unsigned; mixed with signed it would turn float)
    n_grp = (n_ch + cpu - 1) // cpu if split else 1
    c_lo = (ui % n_grp) * cpu if split else 0
    c_hi = min(c_lo + cpu, n_ch) if split else n_ch
    rest = ui // n_grp
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
    sc = np.empty(nq * KT, dtype=np.float32)  # scores, then probabilities, of every query
    mt = np.empty((t1 - t0, KT), dtype=np.float32)  # mask tile of the block's tokens
    tm = np.empty(nq, dtype=np.float32)  # tile maxima
    gs = np.zeros(4, dtype=np.int64)  # a P·V group: sc offsets, state rows
    gr = np.zeros(4, dtype=np.int64)
    cm = np.full(2 * nq, NEG_INF, dtype=np.float32)  # chunk partials: max, sum of p, sum of p * v;
    cs = np.zeros(2 * nq, dtype=np.float32)  # rows nq + qi: the start chunk's cells before the start tile
    ca = np.zeros((2 * nq, dv), dtype=np.float32)
    rm = np.full(nq, NEG_INF, dtype=np.float32)  # running result over the chunks folded so far
    rs = np.zeros(nq, dtype=np.float32)
    ra = np.zeros((nq, dv), dtype=np.float32)
    c_first = 0 if split else start[t0] // CHUNK
    for ci in range(c_lo, c_hi):
        c = ci if split else (c_first + ci) % n_ch
        _chunk(
            qb,
            gq,
            t0,
            t1,
            mask,
            start,
            k,
            type_k,
            v,
            type_v,
            st,
            hk * kb,
            kb,
            hk * vb,
            vb,
            scale,
            softcap,
            c * CHUNK,
            min((c + 1) * CHUNK, n_kv),
            kt,
            vt,
            sc,
            mt,
            tm,
            gs,
            gr,
            cm,
            cs,
            ca,
        )
        for qi in range(nq):
            if split:
                t = t0 + qi // gq
                h = h0 + qi % gq
                pm[c, t, h] = cm[qi]
                ps[c, t, h] = cs[qi]
                for e in range(dv):
                    pacc[c, t, h, e] = ca[qi, e]
                if start[t] // CHUNK == c:
                    bm[t, h] = cm[nq + qi]
                    bs[t, h] = cs[nq + qi]
                    for e in range(dv):
                        bacc[t, h, e] = ca[nq + qi, e]
            else:
                rm[qi], rs[qi] = _fold(rm[qi], rs[qi], ra[qi], cm[qi], cs[qi], ca[qi])
    if not split:
        for qi in range(nq):
            rm[qi], rs[qi] = _fold(rm[qi], rs[qi], ra[qi], cm[nq + qi], cs[nq + qi], ca[nq + qi])
            _finish(rm[qi], rs[qi], ra[qi], out[t0 + qi // gq, h0 + qi % gq])


@njit(cache=True)
def _merge_partials(pm, ps, pacc, bm, bs, bacc, start, out):
    """Fold the chunks' partial softmaxes of every query in chunk order from its start chunk on,
    then the start chunk's part before the start tile (as an unsplit unit does)."""
    n_ch, n_tokens, n_head, dv = pacc.shape
    a = np.empty(dv, dtype=np.float32)
    for t in range(n_tokens):
        c0 = start[t] // CHUNK
        for h in range(n_head):
            m = NEG_INF
            s = np.float32(0.0)
            for e in range(dv):
                a[e] = 0.0
            for ci in range(n_ch):
                c = (c0 + ci) % n_ch
                m, s = _fold(m, s, a, pm[c, t, h], ps[c, t, h], pacc[c, t, h])
            m, s = _fold(m, s, a, bm[t, h], bs[t, h], bacc[t, h])
            _finish(m, s, a, out[t, h])


def _partials(n_kv, n_tokens, n_head, dv):
    """Partial-softmax buffers of a split launch: per chunk, and for the start chunk's part
    before the start tile (-inf: nothing there)."""
    n_ch = -(-n_kv // CHUNK)
    return (
        np.empty((n_ch, n_tokens, n_head), dtype=np.float32),  # max per chunk
        np.empty((n_ch, n_tokens, n_head), dtype=np.float32),  # sum of p per chunk
        np.empty((n_ch, n_tokens, n_head, dv), dtype=np.float32),  # sum of p * v per chunk
        np.full((n_tokens, n_head), NEG_INF, dtype=np.float32),
        np.zeros((n_tokens, n_head), dtype=np.float32),
        np.zeros((n_tokens, n_head, dv), dtype=np.float32),
    )


# an unsplit launch never touches the partials: empty buffers of the kernels' types
_NO_PARTIALS = (
    np.empty((0, 0, 0), dtype=np.float32),
    np.empty((0, 0, 0), dtype=np.float32),
    np.empty((0, 0, 0, 0), dtype=np.float32),
    np.empty((0, 0), dtype=np.float32),
    np.empty((0, 0), dtype=np.float32),
    np.empty((0, 0, 0), dtype=np.float32),
)


@njit(cache=True, parallel=True)
def _flash_attn_par(
    q,
    k,
    type_k,
    v,
    type_v,
    mask,
    start,
    tok_stream,
    n_head_kv,
    scale,
    softcap,
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
):
    """q: [n_tokens, n_head, dk] f32; k: [n_stream, >=n_kv, row_k] u8; v: [n_stream, >=n_kv, row_v] u8;
    mask: [n_tokens, n_kv] f32 (0 / -inf); start: [n_tokens] i64; tok_stream: [n_tokens] i32;
    out: [n_tokens, n_head, dv] f32. One parallel launch over the n_units units, then (split) the serial merge."""
    for u in prange(n_units):
        _flash_unit(
            u,
            q,
            k,
            type_k,
            v,
            type_v,
            mask,
            start,
            tok_stream,
            n_head_kv,
            scale,
            softcap,
            tb,
            split,
            cpu,
            pm,
            ps,
            pacc,
            bm,
            bs,
            bacc,
            out,
        )
    if split:
        _merge_partials(pm, ps, pacc, bm, bs, bacc, start, out)


@njit(cache=True)
def _flash_attn_ser(
    q,
    k,
    type_k,
    v,
    type_v,
    mask,
    start,
    tok_stream,
    n_head_kv,
    scale,
    softcap,
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
):
    for u in range(n_units):
        _flash_unit(
            u,
            q,
            k,
            type_k,
            v,
            type_v,
            mask,
            start,
            tok_stream,
            n_head_kv,
            scale,
            softcap,
            tb,
            split,
            cpu,
            pm,
            ps,
            pacc,
            bm,
            bs,
            bacc,
            out,
        )
    if split:
        _merge_partials(pm, ps, pacc, bm, bs, bacc, start, out)


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
    flat = q.reshape(-1, q.shape[-1])  # [n_tokens * n_head, dk]; dk is a multiple of 32
    return dequantize(quantize(flat, _Q8_0), _Q8_0, q.shape[-1]).reshape(q.shape)


def flash_plan(n_tokens, n_head_kv, n_kv, n_stream, n_threads=2):
    """Flash path work split -> (token block, split, chunks per unit). A unit is (kv head, token
    block) and walks all chunks; a generated token has only n_head_kv such units, too few for the
    threads, so then (split) the chunks of CHUNK cells are dealt out in groups — about four units
    per thread — and their partials folded afterwards. The chunks and their fold are the same
    either way, so the split changes the work division only, never a result."""
    tb = 1 if n_stream > 1 else min(32, max(1, n_tokens))
    base = n_head_kv * -(-n_tokens // tb)
    n_ch = -(-n_kv // CHUNK)
    if n_threads <= 1 or base >= 4 * n_threads or n_ch < 2:
        return tb, False, n_ch
    groups = min(n_ch, -(-4 * n_threads // base))
    return tb, True, -(-n_ch // groups)


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
    )


def attention_checked(q, k, type_k, v, type_v, mask, tok_stream, start, n_head_kv, scale, softcap, flash, n_threads):
    """attention() for a caller whose arguments are already in the kernels' types, as the
    forward pass's are (runtime/arch/blocks.py): q C-contiguous f32 [n_tokens, n_head, dk],
    mask C-contiguous f32 [n_tokens, n_kv], tok_stream C-contiguous i32 [n_tokens], start None or
    C-contiguous i64 [n_tokens] in [0, n_kv), type_k / type_v / n_head_kv ints, scale and softcap
    np.float32, flash a bool. Same kernels, same results; the conversions and checks a generated
    token does not need (30 layers a token) are left to attention()."""
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
        parallel.ATTN_PAR_MIN_MACS,
    )
    plan = _LAUNCHES.get(key)
    if plan is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:  # prefill shapes vary; generation repeats a few
            _LAUNCHES.clear()
        plan = _LAUNCHES[key] = _launch_plan(*key)
    fn, tb, split, cpu, n_units, dv, start0 = plan
    out = np.empty((n_tokens, n_head, dv), dtype=np.float32)
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
            tb,
            split,
            n_units,
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
    if dk % LANES or dv % LANES:
        raise ValueError(f"attention: head sizes must be multiples of {LANES} (got K {dk}, V {dv})")
    par = n_threads > 1 and n_tokens * n_head * n_kv * dk >= par_min
    start0 = np.zeros(n_tokens, dtype=np.int64)
    if flash:
        tb, split, cpu = flash_plan(n_tokens, n_head_kv, n_kv, n_stream, n_threads if par else 1)
        n_ch = -(-n_kv // CHUNK)
        n_units = n_head_kv * -(-n_tokens // tb) * (-(-n_ch // cpu) if split else 1)
        return (_flash_attn_par if par else _flash_attn_ser, int(tb), bool(split), int(cpu), int(n_units), dv, start0)
    tb, hpg = classic_plan(n_tokens, n_head, n_head_kv, n_stream, n_threads if par else 1)
    n_units = classic_n_units(np.empty((n_tokens, n_head, 0), dtype=np.float32), n_head_kv, tb, hpg)
    return classic_attn_par if par else classic_attn_ser, int(tb), int(hpg), 0, int(n_units), dv, start0


def _values_per_bytes(t, nbytes):
    """How many values nbytes of format t hold."""
    ti = type_info(t)
    return nbytes // ti.type_size * ti.block_size
