"""The numba kernel behind kernels/matmul.py, on the row-interleaved layouts of kernels/repack.py.

One kernel, ``matmul_blocks``, for every layout (nib, i8, f32, f16, bf16) and every number of tokens, so
that each output element ``y[t, r]`` is computed by the same operations in the same order
whatever n is, whatever the other rows of x are and whatever the thread count — the property
that makes decoding token by token give the logits of decoding in one batch (an f16 KV cache
turns a last-bit difference of a K/V value into a half-ulp step that grows over the layers).

Per output element, for each block b of B values (B = 32, or 16 for q2_K/q3_K/q6_K, 32 for the
float layout):
    s_a = sum over j < B/2 of q[j] * x[j]          (fma chain, j ascending, from +0)
    s_b = sum over j < B/2 of q[B/2 + j] * x[B/2 + j]
    acc = fma(d, s_a + s_b, acc)                     (acc + (s_a + s_b) when there is no scale)
    acc = fma(mn, xsum_b, acc)                       (only the formats with an offset)
with q the block's integer values (exact in f32) and xsum_b the sum of the block's B x values
in a fixed tree (``block_sums``). All arithmetic is the explicit vector operations of
kernels/simd.py, which LLVM may not reorder or fuse differently; so the three code paths below
(several tokens from a decoded block, one token from that block, one token decoding in
registers) give bit-identical results, and the tests assert it with array_equal.

Work split: prange over (row group of R = 32 rows, chunk of TOKEN_CHUNK tokens) items; an item
computes its 32 x chunk outputs alone, so threads never share an element. Within an item, for
each block: with >= 4 tokens the block is decoded once to a small f32 scratch [B, R] and the
tokens go through it four at a time — 16 accumulators (4 tokens x 2 halves of the 32 rows x
s_a/s_b) stay in zmm registers, each weight vector load feeds 4 FMAs; the leftover tokens go
one at a time through the same scratch. With fewer than 4 tokens (generation) the block is
decoded in registers, no scratch.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kvchat.kernels.repack import R
from kvchat.kernels.simd import prefetch, vadd, vbcast, vfma, vhsum, vload, vload_hi, vload_lo, vstore, vzero

PF_BYTES = 2048
SCRATCH_MIN_TOKENS = 8


def _pair(q, base, j, h):
    """Values j and j + h of the block starting at flat index base of q, as four f32 vectors
    (value j rows 0-15, rows 16-31, value j + h rows 0-15, rows 16-31). Only inside kernels."""
    raise NotImplementedError


@overload(_pair, inline="always")
def _pair_impl(q, base, j, h):
    if q.dtype == types.uint8:  # nib: byte j holds value j (low nibble) and value j + 16 (high)

        def nib(q, base, j, h):
            o = base + j * R
            return vload_lo(q, o), vload_lo(q, o + 16), vload_hi(q, o), vload_hi(q, o + 16)

        return nib

    def one_per_element(q, base, j, h):  # i8 values, f32 weights or f16 / bf16 weights (u16 / i16, widened by vload)
        o = base + j * R
        p = o + h * R
        return vload(q, o), vload(q, o + 16), vload(q, p), vload(q, p + 16)

    return one_per_element


def _block_values(q):
    """Values per block (per scale) of a packed array: nib holds two per byte."""
    raise NotImplementedError


@overload(_block_values, inline="always")
def _block_values_impl(q):
    if q.dtype == types.uint8:
        return lambda q: 2 * q.shape[2]
    return lambda q: q.shape[2]


@njit(inline="always")
def _dot_step(s, wa0, wa1, wb0, wb1, xa, xb):
    """One step of the block dot: s = (s_a rows 0-15, s_a rows 16-31, s_b rows 0-15, s_b rows 16-31)."""
    ba = vbcast(xa)
    bb = vbcast(xb)
    return vfma(wa0, ba, s[0]), vfma(wa1, ba, s[1]), vfma(wb0, bb, s[2]), vfma(wb1, bb, s[3])


@njit(inline="always")
def _block_into_acc(a0, a1, s, d0, d1, m0, m1, xsum, has_d, has_mn):
    """acc (rows 0-15, 16-31) += d * (s_a + s_b) [+ mn * xsum]: the block's scale and offset."""
    t0 = vadd(s[0], s[2])
    t1 = vadd(s[1], s[3])
    if has_d:
        a0 = vfma(d0, t0, a0)
        a1 = vfma(d1, t1, a1)
    else:
        a0 = vadd(a0, t0)
        a1 = vadd(a1, t1)
    if has_mn:
        bx = vbcast(xsum)
        a0 = vfma(m0, bx, a0)
        a1 = vfma(m1, bx, a1)
    return a0, a1


@njit(inline="always")
def _fold_group(acc, xs, i0, t, b, ng, s0, s1, s2, s3, d0, d1, m0, m1, has_d, has_mn):
    """Block b's sums s0..s3 of tokens t .. t + ng - 1 into their rows of acc (token t at acc
    row i0): scale, offset term and the running sum, as _block_into_acc spells them."""
    for u in range(ng):
        s = s0 if u == 0 else (s1 if u == 1 else (s2 if u == 2 else s3))
        ia = (i0 + u) * R
        a0, a1 = _block_into_acc(
            vload(acc, ia),
            vload(acc, ia + 16),
            s,
            d0,
            d1,
            m0,
            m1,
            xs[t + u, b] if has_mn else np.float32(0.0),
            has_d,
            has_mn,
        )
        vstore(acc, ia, a0)
        vstore(acc, ia + 16, a1)


@njit(cache=True)
def block_sums(x, B):
    """x f32 [n, k] -> f32 [n, k // B]: each block's sum, by the same tree for every row."""
    n, k = x.shape
    nb = k // B
    xs = np.empty((n, nb), np.float32)
    for t in range(n):
        for b in range(nb):
            o = t * k + b * B
            v = vload(x, o)
            for i in range(16, B, 16):
                v = vadd(v, vload(x, o + i))
            xs[t, b] = vhsum(v)
    return xs


@njit(parallel=True, cache=True)
def matmul_blocks(q, d, mn, x, y, token_chunk, n_runs):
    """y = x @ W.T for a packed matrix. q [G, nb, QB, R]: u8 nibble pairs (QB = 16 bytes for 32
    values), i8 values, f32 weights or f16 / bf16 weights as u16 / i16 bits (QB = B values); d, mn
    [G, nb, R] f32 or u16 (f16 bits), each possibly empty [0, 0, 0] (no scale: float weights; no
    offset: symmetric formats);
    x f32 [n, nb * B] C-contiguous -> y f32 [n, m], m <= G * R. The (row group, token chunk)
    items are cut into n_runs runs of consecutive items, one prange iteration each (a few per
    thread: each run allocates its scratch once); how they are cut never changes a result."""
    G = q.shape[0]
    n = y.shape[0]
    xs = block_sums(x, _block_values(q)) if mn.size > 0 else np.zeros((0, 0), np.float32)  # [n, nb]
    n_tc = (n + token_chunk - 1) // token_chunk
    n_items = G * n_tc
    n_par = max(1, min(n_items, n_runs))
    for p in prange(n_par):
        # consecutive items: a row group's token chunks follow each other, its weights stay in cache
        _run_items(q, d, mn, x, xs, y, token_chunk, p * n_items // n_par, (p + 1) * n_items // n_par)


@njit(cache=True)
def matmul_blocks_serial(q, d, mn, x, y, token_chunk):
    """matmul_blocks on the calling thread only (a small product, e.g. a MoE router's f32 rows
    for a decoded token: less work than a parallel launch); same results."""
    n = y.shape[0]
    xs = block_sums(x, _block_values(q)) if mn.size > 0 else np.zeros((0, 0), np.float32)  # [n, nb]
    n_items = q.shape[0] * ((n + token_chunk - 1) // token_chunk)
    _run_items(q, d, mn, x, xs, y, token_chunk, np.int64(0), n_items)


@njit(cache=True)
def _run_items(q, d, mn, x, xs, y, token_chunk, i0, i1):
    """Work items i0 .. i1 - 1 of matmul_blocks (item = row group * n_chunks + token chunk).
    A separate serial function, so that the parallel kernel's body stays small: numba's parfor
    passes on the whole body took 7 of the 9.5 s of compiling one specialization."""
    nb, QB = q.shape[1], q.shape[2]
    B = _block_values(q)
    h = B // 2
    n, m = y.shape
    has_d = d.size > 0
    has_mn = mn.size > 0
    n_tc = (n + token_chunk - 1) // token_chunk
    acc = np.empty(min(n, token_chunk) * R, np.float32)  # [tokens of a chunk, R] row sums
    w = np.empty(B * R, np.float32)  # [B, R] one decoded block
    z = vzero()
    pf = PF_BYTES // q.itemsize
    for it in range(i0, i1):
        g = it // n_tc
        t0 = (it - g * n_tc) * token_chunk
        t1 = min(n, t0 + token_chunk)
        nt = t1 - t0
        for i in range(0, nt * R, 16):
            vstore(acc, i, z)
        for b in range(nb):
            x0 = b * B
            base = (g * nb + b) * QB * R  # flat index of q[g, b, 0, 0]
            sb = (g * nb + b) * R  # flat index of d[g, b, 0]
            d0, d1, m0, m1 = z, z, z, z
            if has_d:
                d0, d1 = vload(d, sb), vload(d, sb + 16)
            if has_mn:
                m0, m1 = vload(mn, sb), vload(mn, sb + 16)
            t = t0
            if nt >= SCRATCH_MIN_TOKENS:  # decode the block once for the whole chunk
                for j in range(h):
                    prefetch(q, base + j * R + pf)
                    prefetch(q, base + (h + j) * R + pf)
                    wa0, wa1, wb0, wb1 = _pair(q, base, j, h)
                    vstore(w, j * R, wa0)
                    vstore(w, j * R + 16, wa1)
                    vstore(w, (h + j) * R, wb0)
                    vstore(w, (h + j) * R + 16, wb1)
                while t + 4 <= t1:  # four tokens per pass over the block
                    s0 = (z, z, z, z)
                    s1 = (z, z, z, z)
                    s2 = (z, z, z, z)
                    s3 = (z, z, z, z)
                    for j in range(h):
                        wa0, wa1 = vload(w, j * R), vload(w, j * R + 16)
                        wb0, wb1 = vload(w, (h + j) * R), vload(w, (h + j) * R + 16)
                        s0 = _dot_step(s0, wa0, wa1, wb0, wb1, x[t, x0 + j], x[t, x0 + h + j])
                        s1 = _dot_step(s1, wa0, wa1, wb0, wb1, x[t + 1, x0 + j], x[t + 1, x0 + h + j])
                        s2 = _dot_step(s2, wa0, wa1, wb0, wb1, x[t + 2, x0 + j], x[t + 2, x0 + h + j])
                        s3 = _dot_step(s3, wa0, wa1, wb0, wb1, x[t + 3, x0 + j], x[t + 3, x0 + h + j])
                    _fold_group(acc, xs, t - t0, t, b, 4, s0, s1, s2, s3, d0, d1, m0, m1, has_d, has_mn)
                    t += 4
                while t < t1:  # the chunk's last tokens, one at a time, same scratch
                    s0 = (z, z, z, z)
                    for j in range(h):
                        s0 = _dot_step(
                            s0,
                            vload(w, j * R),
                            vload(w, j * R + 16),
                            vload(w, (h + j) * R),
                            vload(w, (h + j) * R + 16),
                            x[t, x0 + j],
                            x[t, x0 + h + j],
                        )
                    _fold_group(acc, xs, t - t0, t, b, 1, s0, s0, s0, s0, d0, d1, m0, m1, has_d, has_mn)
                    t += 1
            else:  # fewer tokens (generation, a verify batch): decode in registers, four tokens per pass
                while t < t1:
                    ng = min(4, t1 - t)
                    s0 = (z, z, z, z)
                    s1 = (z, z, z, z)
                    s2 = (z, z, z, z)
                    s3 = (z, z, z, z)
                    for j in range(h):
                        if t == t0:
                            prefetch(q, base + j * R + pf)
                            prefetch(q, base + (h + j) * R + pf)
                        wa0, wa1, wb0, wb1 = _pair(q, base, j, h)
                        s0 = _dot_step(s0, wa0, wa1, wb0, wb1, x[t, x0 + j], x[t, x0 + h + j])
                        if ng > 1:
                            s1 = _dot_step(s1, wa0, wa1, wb0, wb1, x[t + 1, x0 + j], x[t + 1, x0 + h + j])
                        if ng > 2:
                            s2 = _dot_step(s2, wa0, wa1, wb0, wb1, x[t + 2, x0 + j], x[t + 2, x0 + h + j])
                        if ng > 3:
                            s3 = _dot_step(s3, wa0, wa1, wb0, wb1, x[t + 3, x0 + j], x[t + 3, x0 + h + j])
                    _fold_group(acc, xs, t - t0, t, b, ng, s0, s1, s2, s3, d0, d1, m0, m1, has_d, has_mn)
                    t += ng
        r1 = min(R, m - g * R)  # the last group's padding rows are not written
        for t in range(t0, t1):
            ia = (t - t0) * R
            if r1 == R:
                vstore(y, t * m + g * R, vload(acc, ia))
                vstore(y, t * m + g * R + 16, vload(acc, ia + 16))
            else:
                for r in range(r1):
                    y[t, g * R + r] = acc[ia + r]
