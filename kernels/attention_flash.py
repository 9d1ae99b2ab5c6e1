"""The flash path of attention (llama.cpp's flash_attn_ext on the CPU): online softmax over K/V
tiles read in their cache format, in chunks of CHUNK cells folded in chunk order (`_fold`),
whether one unit walks all of a query's chunks or the chunks are dealt out over threads and
their partials merged afterwards (flash-decoding, for few queries: `flash_plan`). The hot loop
is `_chunk`: per unit and chunk, the K/V tiles decoded once, then each query's scores and
online-softmax step. kernels/attention.py dispatches here and says why every sum has its fixed
order (batch invariance); the tile-level pieces are kernels/attention_tiles.py.
"""

import numpy as np
from numba import njit, prange

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
from kvchat.kernels.simd import LANES

PREFETCH = 2  # tiles ahead that _chunk asks the cache rows of
CHUNK = 256  # cells per flash chunk: a fixed multiple of KT, never derived from the call's shape


@njit(cache=True)
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
        n = np.int64(0)  # i64 throughout (no literal): tile_pv is compiled once, not per constant
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
                tile_pv(n, sc, gs[0], gs[1], gs[2], gs[3], vt, acc, gr[0], gr[1], gr[2], gr[3])
                n = np.int64(0)
        if n:
            tile_pv(n, sc, gs[0], gs[1], gs[2], gs[3], vt, acc, gr[0], gr[1], gr[2], gr[3])


@njit(cache=True, forceinline=True, _nrt=False)
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


@njit(cache=True, forceinline=True, _nrt=False)
def _finish(m, s, a, o):
    """o [dv] <- a / s; zeros for a query that saw no cell (as ggml)."""
    if m == NEG_INF:
        for e in range(o.shape[0]):
            o[e] = 0.0
        return
    inv = np.float32(1.0) / s
    for e in range(o.shape[0]):
        o[e] = a[e] * inv


@njit(cache=True)
def _flash_units(
    u0,
    u1,
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
    sinks,
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
    """Work units u0 .. u1 - 1 of the flash path, in turn. A unit is (kv head, token block), or
    with split (kv head, token block, group of cpu chunks). Every query head of the kv head's
    group and every token of the block is computed against each dequantized tile, so a K/V row is decoded once per unit.
    Without split the unit folds all chunks, from the start chunk of its first token on
    (cyclically), then the part of the start chunk before the start tile, and writes out; with
    split it stores each chunk's partial softmax in pm/ps/pacc [n_ch, n_tokens, n_head(, dv)] and
    that last part in bm/bs/bacc [n_tokens, n_head(, dv)] for _merge_partials. sinks f32 [n_head]
    (empty: none): each head's learned logit is folded in last as a chunk of one cell with value
    zero (ggml's flash_attn_ext: S = S * ms + vs).
    The serial path calls this from Python (then _merge_partials) and the parallel kernel calls
    it per unit from its prange: one compiled body, and no kernel level in between — numba links
    every callee's code into its caller's module and LLVM optimizes and emits it again there, so
    each level of a call chain costs another compile of everything below it."""
    for u in range(u0, u1):
        n_tokens, n_head, dk = q.shape
        dv = out.shape[2]
        dkp = (dk + LANES - 1) // LANES * LANES  # head sizes padded with zero components (load_tile)
        dvp = (dv + LANES - 1) // LANES * LANES
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
        qb = np.zeros((nq, dkp), dtype=np.float32)  # the unit's queries, contiguous, zero-padded
        for qi in range(nq):
            for e in range(dk):
                qb[qi, e] = q[t0 + qi // gq, h0 + qi % gq, e]
        kt = np.zeros((KT, dkp), dtype=np.float32)  # dequantized K tile (columns from dk on stay 0)
        vt = np.zeros((KT, dvp), dtype=np.float32)  # dequantized V tile (columns from dv on stay 0)
        sc = np.empty(nq * KT, dtype=np.float32)  # scores, then probabilities, of every query
        mt = np.empty((t1 - t0, KT), dtype=np.float32)  # mask tile of the block's tokens
        tm = np.empty(nq, dtype=np.float32)  # tile maxima
        gs = np.zeros(4, dtype=np.int64)  # a P·V group: sc offsets, state rows
        gr = np.zeros(4, dtype=np.int64)
        cm = np.full(2 * nq, NEG_INF, dtype=np.float32)  # chunk partials: max, sum of p, sum of p * v;
        cs = np.zeros(2 * nq, dtype=np.float32)  # rows nq + qi: the start chunk's cells before the start tile
        ca = np.zeros((2 * nq, dvp), dtype=np.float32)
        rm = np.full(nq, NEG_INF, dtype=np.float32)  # running result over the chunks folded so far
        rs = np.zeros(nq, dtype=np.float32)
        ra = np.zeros((nq, dvp), dtype=np.float32)
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
            z = np.zeros(dvp, dtype=np.float32)  # a sink's p * v: it weighs no V row
            for qi in range(nq):
                rm[qi], rs[qi] = _fold(rm[qi], rs[qi], ra[qi], cm[nq + qi], cs[nq + qi], ca[nq + qi])
                if sinks.shape[0] > 0:  # the head's sink joins the softmax last (ggml's flash_attn_ext)
                    rm[qi], rs[qi] = _fold(rm[qi], rs[qi], ra[qi], sinks[h0 + qi % gq], np.float32(1.0), z)
                _finish(rm[qi], rs[qi], ra[qi], out[t0 + qi // gq, h0 + qi % gq])


@njit(cache=True)
def _merge_partials(pm, ps, pacc, bm, bs, bacc, start, sinks, out):
    """Fold the chunks' partial softmaxes of every query in chunk order from its start chunk on,
    then the start chunk's part before the start tile (as an unsplit unit does)."""
    n_ch, n_tokens, n_head, dv = pacc.shape
    a = np.empty(dv, dtype=np.float32)
    z = np.zeros(dv, dtype=np.float32)  # a sink's p * v: it weighs no V row
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
            if sinks.shape[0] > 0:
                m, s = _fold(m, s, a, sinks[h], np.float32(1.0), z)
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
):
    """q: [n_tokens, n_head, dk] f32; k: [n_stream, >=n_kv, row_k] u8; v: [n_stream, >=n_kv, row_v] u8;
    mask: [n_tokens, n_kv] f32 (0 / -inf); start: [n_tokens] i64; tok_stream: [n_tokens] i32;
    out: [n_tokens, n_head, dv] f32. One parallel launch over the n_units units, then (split) the serial merge."""
    for u in prange(n_units):
        _flash_units(  # i64 bounds: the serial kernel's types, so both use one compiled version
            np.int64(u),
            np.int64(u) + 1,
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
            sinks,
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
        _merge_partials(pm, ps, pacc, bm, bs, bacc, start, sinks, out)


def flash_attn_ser(
    q, k, type_k, v, type_v, mask, start, tok_stream, n_head_kv, scale, softcap, sinks, tb, split, cpu, n_units, *rest
):
    """_flash_attn_par's serial twin, with its arguments (rest: pm, ps, pacc, bm, bs, bacc, out):
    the units in turn, then (split) the merge. Plain Python over two kernels, so that no kernel
    level sits above _flash_units (its docstring says why)."""
    pm, ps, pacc, bm, bs, bacc, out = rest
    _flash_units(  # i64 bounds, as the parallel kernel's: one compiled version for both
        np.int64(0),
        np.int64(n_units),
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
        sinks,
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
        _merge_partials(pm, ps, pacc, bm, bs, bacc, start, sinks, out)


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
