"""y = x · Wᵀ for a block-quantized W by exact integer block dot products (ggml's vec_dot scheme).

One kernel, ``matmul_q``, for every weight type of kernels/qlayout.py and every number of
tokens. Each row of x is first quantized to the weight's activation format
(kernels/quant_act.py: q8_0, q8_1 or q8_K, ggml's rounding); then for output element y[t, r],
per sub-block j of S values (signed weight values w = stored - offset):

    i_j  = sum_v w[r, v] * xq[t, v]                        (exact: i32 integer dot products)
    legacy formats (one sub-block per 32-block b):
        acc = fma(d[r, b] * xd[t, b], float(i_b), acc)
        acc = fma(m[r, b], xm[t, b], acc)                 (q4_1 / q5_1: q8_1's s term)
    K-quants (super-block B of 256 values):
        I = sum_j sc[r, j] * i_j,  M = sum_j mn[r, j] * xsum_j           (exact integers)
        acc = fma(d[r, B] * xd[t, B], float(I), acc)
        acc = fma(-dmin[r, B] * xd[t, B], float(M), acc)  (q4_K / q5_K / q2_K)

blocks in ascending order, from +0. This is ggml's arithmetic (integer sums inside a block,
one float scale step per block) with one fixed float order, so y[t] depends on row t of x
only — bit for bit whatever n, the other rows, the token chunk, the thread count and the
instruction path (kernels/simd_int.py: the integers are the same on every path, and the float
steps are the same explicit kernels/simd.py operations). tests/test_matmul_int.py asserts it
with array_equal.

Work split: prange over runs of (32-row group, chunk of token_chunk tokens) items, as
kernels/matmul_kernels.py; an item computes each of its tokens in turn over the whole row
(the row group's weights stay in L1/L2 across the chunk's tokens).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from kvchat.kernels.matmul_lanes import lanes_impl
from kvchat.kernels.parallel import QUANT_ACT_PAR_MIN_ROWS
from kvchat.kernels.qlayout import ACT_Q8_K, QFormatType, R
from kvchat.kernels.quant_act import quantize_row_q8  # NaN-keeping block scales (#24): inlined here
from kvchat.kernels.simd import vadd, vbcast, vfma, vload, vmul, vscale, vstore, vzero
from kvchat.kernels.simd_int import (
    bhi,
    blo,
    bload,
    blut,
    bmerge,
    bplane,
    bstore,
    iadd,
    ibcast,
    idot,
    idot_s,
    iload8,
    imul,
    isub,
    itof,
    izero,
    prefetch,
    s8_bias,
)

# _row (1-3 tokens: generation) asks for the weight bytes this far ahead of the sub-block it is
# multiplying. At one token a product streams its weights once, bound by memory latency more than
# by its instructions: on the 2-core EPYC (Zen 3, AVX2) a lone thread's Q4_K product of the
# 1.5B-shaped model's gate+up ran 35-39 ms without, 28-30 ms with (docs/performance.md, issue 24).
PREFETCH_BYTES = 2048
PREFETCH_MAX_TOKENS = 16  # _row4 prefetches in chunks of at most this many tokens


def fmt_get(fmt, field):
    """A QFormat field as a compile-time constant inside njit code."""
    raise NotImplementedError


@overload(fmt_get, inline="always")
def _fmt_get(fmt, field):
    if isinstance(fmt, QFormatType) and isinstance(field, types.StringLiteral):
        v = getattr(fmt.fmt, field.literal_value)
        return lambda fmt, field: v
    return None


@njit(cache=True, inline="always")
def _nib_vectors(fmt, q, base, s):
    """Step s of a nibble sub-block at byte base: the values of rows 0-15 and 16-31 for the low
    half (values 4s .. 4s+3) and the high half (S/2 + 4s ..), with the high bits of the 5- and
    6-bit formats ORed in as bits 4 and 5 (kernels/qlayout.py): the 5-bit formats' plane by a
    masked byte move, q6_K's crumbs (two bits a value, four vectors a byte) by shift, mask and OR."""
    v0 = bload(q, base + s * 128)
    v1 = bload(q, base + s * 128 + 64)
    l0, l1, h0, h1 = blo(v0), blo(v1), bhi(v0), bhi(v1)
    P = fmt_get(fmt, "planes")
    if P == 1:
        pb = base + fmt_get(fmt, "sub") * R // 2 + s * 32
        l0, l1 = bplane(l0, q, pb, 16), bplane(l1, q, pb + 8, 16)
        h0, h1 = bplane(h0, q, pb + 16, 16), bplane(h1, q, pb + 24, 16)
    elif P == 2:
        w = bload(q, base + fmt_get(fmt, "sub") * R // 2 + s * 64)
        l0, l1 = bmerge(l0, w, 4, 0x30), bmerge(l1, w, 2, 0x30)
        h0, h1 = bmerge(h0, w, 0, 0x30), bmerge(h1, w, -2, 0x30)
    return l0, l1, h0, h1


@njit(cache=True, inline="always")
def _nib_values(isa, fmt, q, base, s):
    """_nib_vectors, each nibble mapped through the format's table when it has one (mxfp4)."""
    l0, l1, h0, h1 = _nib_vectors(fmt, q, base, s)
    return blut(isa, fmt, l0), blut(isa, fmt, l1), blut(isa, fmt, h0), blut(isa, fmt, h1)


@njit(cache=True, inline="always")
def _sub_dot(isa, fmt, q, base, x32, t, xo):
    """Integer dots of one sub-block for the 32 rows of a group: (rows 0-15, rows 16-31), raw
    (offset and signed bias not yet removed)."""
    p0, p1, p2, p3 = izero(), izero(), izero(), izero()
    if fmt_get(fmt, "nib"):
        H = fmt_get(fmt, "sub") // 8  # steps per nibble half
        for s in range(H):
            l0, l1, h0, h1 = _nib_values(isa, fmt, q, base, s)
            xl = x32[t, xo + s]
            xh = x32[t, xo + H + s]
            p0 = idot(isa, p0, l0, xl)
            p1 = idot(isa, p1, l1, xl)
            p2 = idot(isa, p2, h0, xh)
            p3 = idot(isa, p3, h1, xh)
    else:
        S = fmt_get(fmt, "sub")
        for s in range(0, S // 4, 2):
            xa = x32[t, xo + s]
            xb = x32[t, xo + s + 1]
            if fmt_get(fmt, "signed"):
                p0 = idot_s(isa, p0, bload(q, base + s * 128), xa)
                p1 = idot_s(isa, p1, bload(q, base + s * 128 + 64), xa)
                p2 = idot_s(isa, p2, bload(q, base + s * 128 + 128), xb)
                p3 = idot_s(isa, p3, bload(q, base + s * 128 + 192), xb)
            else:
                p0 = idot(isa, p0, bload(q, base + s * 128), xa)
                p1 = idot(isa, p1, bload(q, base + s * 128 + 64), xa)
                p2 = idot(isa, p2, bload(q, base + s * 128 + 128), xb)
                p3 = idot(isa, p3, bload(q, base + s * 128 + 192), xb)
    return iadd(p0, p2), iadd(p1, p3)


@njit(cache=True, inline="always")
def _sub_dot4(isa, fmt, q, base, x32, t, u1, u2, u3, xo):
    """_sub_dot for tokens t, u1, u2, u3 at once: each weight vector is loaded (and its nibbles
    split) once for four tokens. Returns 8 vectors (token u: rows 0-15, rows 16-31). The integers
    equal _sub_dot's (exact sums, only their association differs)."""
    z = izero()
    p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z
    if fmt_get(fmt, "nib"):
        H = fmt_get(fmt, "sub") // 8
        for s in range(H):
            l0, l1, h0, h1 = _nib_values(isa, fmt, q, base, s)
            xl, xh = x32[t, xo + s], x32[t, xo + H + s]
            p0, p1 = idot(isa, idot(isa, p0, l0, xl), h0, xh), idot(isa, idot(isa, p1, l1, xl), h1, xh)
            xl, xh = x32[u1, xo + s], x32[u1, xo + H + s]
            p2, p3 = idot(isa, idot(isa, p2, l0, xl), h0, xh), idot(isa, idot(isa, p3, l1, xl), h1, xh)
            xl, xh = x32[u2, xo + s], x32[u2, xo + H + s]
            p4, p5 = idot(isa, idot(isa, p4, l0, xl), h0, xh), idot(isa, idot(isa, p5, l1, xl), h1, xh)
            xl, xh = x32[u3, xo + s], x32[u3, xo + H + s]
            p6, p7 = idot(isa, idot(isa, p6, l0, xl), h0, xh), idot(isa, idot(isa, p7, l1, xl), h1, xh)
    else:
        S = fmt_get(fmt, "sub")
        for s in range(S // 4):
            v0 = bload(q, base + s * 128)
            v1 = bload(q, base + s * 128 + 64)
            if fmt_get(fmt, "signed"):
                p0, p1 = idot_s(isa, p0, v0, x32[t, xo + s]), idot_s(isa, p1, v1, x32[t, xo + s])
                p2, p3 = idot_s(isa, p2, v0, x32[u1, xo + s]), idot_s(isa, p3, v1, x32[u1, xo + s])
                p4, p5 = idot_s(isa, p4, v0, x32[u2, xo + s]), idot_s(isa, p5, v1, x32[u2, xo + s])
                p6, p7 = idot_s(isa, p6, v0, x32[u3, xo + s]), idot_s(isa, p7, v1, x32[u3, xo + s])
            else:
                p0, p1 = idot(isa, p0, v0, x32[t, xo + s]), idot(isa, p1, v1, x32[t, xo + s])
                p2, p3 = idot(isa, p2, v0, x32[u1, xo + s]), idot(isa, p3, v1, x32[u1, xo + s])
                p4, p5 = idot(isa, p4, v0, x32[u2, xo + s]), idot(isa, p5, v1, x32[u2, xo + s])
                p6, p7 = idot(isa, p6, v0, x32[u3, xo + s]), idot(isa, p7, v1, x32[u3, xo + s])
    return p0, p1, p2, p3, p4, p5, p6, p7


@njit(cache=True, forceinline=True, _nrt=False)
def _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, i0, i1, acc):
    """Sub-block j's raw dots (i0, i1) of token t into acc = (I0, I1, M0, M1): offset removed,
    K-quant sub-scale and min applied — all integer."""
    S = fmt_get(fmt, "sub")
    off = fmt_get(fmt, "offset")
    if fmt_get(fmt, "signed"):
        off = off + s8_bias(isa)
    xsum = xs[t, j * S // 16]
    if S == 32:
        xsum += xs[t, j * 2 + 1]
    if off != 0:
        c = ibcast(off * xsum)
        i0, i1 = isub(i0, c), isub(i1, c)
    I0, I1, M0, M1 = acc
    if fmt_get(fmt, "n_sub") == 1:
        return i0, i1, M0, M1
    so = (g * n_sub_all + j) * R
    I0 = iadd(I0, imul(iload8(sc, so), i0))
    I1 = iadd(I1, imul(iload8(sc, so + 16), i1))
    if fmt_get(fmt, "kmin"):
        bx = ibcast(xsum)
        M0 = iadd(M0, imul(iload8(mn, so), bx))
        M1 = iadd(M1, imul(iload8(mn, so + 16), bx))
    return I0, I1, M0, M1


@njit(cache=True, forceinline=True, _nrt=False)
def _fold_super(fmt, d, m, xd, xm, t, B, g, n_super, acc, a0, a1):
    """Scale block B's integers acc = (I0, I1, M0, M1) of token t into the float sums (a0, a1)."""
    I0, I1, M0, M1 = acc
    so = (g * n_super + B) * R
    dx = vbcast(xd[t, B])
    a0 = vfma(vmul(vscale(d, so), dx), itof(I0), a0)
    a1 = vfma(vmul(vscale(d, so + 16), dx), itof(I1), a1)
    if fmt_get(fmt, "lmin"):
        s = vbcast(xm[t, B])
        a0 = vfma(vload(m, so), s, a0)
        a1 = vfma(vload(m, so + 16), s, a1)
    if fmt_get(fmt, "kmin"):
        a0 = vfma(vmul(vload(m, so), dx), itof(M0), a0)
        a1 = vfma(vmul(vload(m, so + 16), dx), itof(M1), a1)
    return a0, a1


@njit(cache=True, forceinline=True, _nrt=False)
def _store(y, ym, t, g, a0, a1):
    """y[t, 32 g : 32 g + 32] = (a0, a1), the last group's padding rows not written."""
    n_rows = y.shape[1]
    if g * R + R <= n_rows:
        vstore(y, t * n_rows + g * R, a0)
        vstore(y, t * n_rows + g * R + 16, a1)
    else:
        vstore(ym, 0, a0)
        vstore(ym, 16, a1)
        for r in range(n_rows - g * R):
            y[t, g * R + r] = ym[r]


@njit(cache=True, forceinline=True, _nrt=False)
def _row(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, gq, y, ym):
    """y[t, 32 g : 32 g + 32] for one token (the group's values at group gq of q: g, or 0 for
    a group expanded on its own, _expand_group)."""
    S = fmt_get(fmt, "sub")
    NS = fmt_get(fmt, "n_sub")
    n_sub_all = xs.shape[1] * 16 // S
    n_super = n_sub_all // NS
    sub_bytes = fmt_get(fmt, "sub_bytes")
    z = izero()
    a0, a1 = vzero(), vzero()
    for B in range(n_super):
        acc = (z, z, z, z)
        for jj in range(NS):
            j = B * NS + jj
            for c in range(0, sub_bytes, 64):  # one hint a cache line, PREFETCH_BYTES ahead
                prefetch(q, (gq * n_sub_all + j) * sub_bytes + PREFETCH_BYTES + c)
            i0, i1 = _sub_dot(isa, fmt, q, (gq * n_sub_all + j) * sub_bytes, x32, t, j * S // 4)
            acc = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, i0, i1, acc)
        a0, a1 = _fold_super(fmt, d, m, xd, xm, t, B, g, n_super, acc, a0, a1)
    _store(y, ym, t, g, a0, a1)


@njit(cache=True, forceinline=True, _nrt=False)
def _row4(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, gq, y, ym, ng, pf):
    """_row for tokens t .. t + ng - 1 (ng 2-4), sharing each weight load; every token's
    operations and their order are _row's, so the rows are bit-identical to _row calls. A verify
    batch of 2-3 tokens reads and unpacks its weights once, as four tokens do: the spare lanes
    repeat the last token and are not stored (no branch in the loop: one body to compile, and a
    prompt's whole groups run it as before)."""
    S = fmt_get(fmt, "sub")
    NS = fmt_get(fmt, "n_sub")
    n_sub_all = xs.shape[1] * 16 // S
    n_super = n_sub_all // NS
    sub_bytes = fmt_get(fmt, "sub_bytes")
    u1, u2, u3 = t + min(1, ng - 1), t + min(2, ng - 1), t + min(3, ng - 1)
    z = izero()
    f = vzero()
    a = (f, f, f, f, f, f, f, f)
    for B in range(n_super):
        c0, c1, c2, c3 = (z, z, z, z), (z, z, z, z), (z, z, z, z), (z, z, z, z)
        for jj in range(NS):
            j = B * NS + jj
            if pf:  # a short chunk streams its weights once, as _row does: one hint a cache line
                for c in range(0, sub_bytes, 64):
                    prefetch(q, (gq * n_sub_all + j) * sub_bytes + PREFETCH_BYTES + c)
            p = _sub_dot4(isa, fmt, q, (gq * n_sub_all + j) * sub_bytes, x32, t, u1, u2, u3, j * S // 4)
            c0 = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, p[0], p[1], c0)
            c1 = _fold_sub(isa, fmt, sc, mn, xs, u1, j, g, n_sub_all, p[2], p[3], c1)
            c2 = _fold_sub(isa, fmt, sc, mn, xs, u2, j, g, n_sub_all, p[4], p[5], c2)
            c3 = _fold_sub(isa, fmt, sc, mn, xs, u3, j, g, n_sub_all, p[6], p[7], c3)
        a0, a1 = _fold_super(fmt, d, m, xd, xm, t, B, g, n_super, c0, a[0], a[1])
        a2, a3 = _fold_super(fmt, d, m, xd, xm, u1, B, g, n_super, c1, a[2], a[3])
        a4, a5 = _fold_super(fmt, d, m, xd, xm, u2, B, g, n_super, c2, a[4], a[5])
        a6, a7 = _fold_super(fmt, d, m, xd, xm, u3, B, g, n_super, c3, a[6], a[7])
        a = (a0, a1, a2, a3, a4, a5, a6, a7)
    _store(y, ym, t, g, a[0], a[1])
    _store(y, ym, u1, g, a[2], a[3])
    if ng > 2:
        _store(y, ym, u2, g, a[4], a[5])
    if ng > 3:
        _store(y, ym, u3, g, a[6], a[7])


@njit(cache=True, forceinline=True, _nrt=False)
def _fold_super_km(d, m, xd, t, B, g, n_super, acc, a0, a1, b0, b1):
    """_fold_super for a K-quant with mins in ggml's repacked gemm order (QFormat.lanes: q4_K,
    ggml_gemm_q4_K_8x8_q8_K): the scales' terms of a sub-block pair of super-block B into
    (a0, a1), the mins' into their own (b0, b1)."""
    I0, I1, M0, M1 = acc
    so = (g * n_super + B) * R
    dx = vbcast(xd[t, B])
    a0 = vfma(vmul(vscale(d, so), dx), itof(I0), a0)
    a1 = vfma(vmul(vscale(d, so + 16), dx), itof(I1), a1)
    b0 = vfma(vmul(vload(m, so), dx), itof(M0), b0)
    b1 = vfma(vmul(vload(m, so + 16), dx), itof(M1), b1)
    return a0, a1, b0, b1


@njit(cache=True, forceinline=True, _nrt=False)
def _row4_km(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym, ng):
    """_row4 (ng 1-4 tokens) in the float order of ggml's repacked q4_K gemm (x86
    arch/x86/repack.cpp ggml_gemm_q4_K_8x8_q8_K, which llama.cpp runs for 4 tokens and more: a
    prompt's batch; its one-token gemv steps per super-block instead): per pair of sub-blocks
    (64 values) acc = fma(float(I), d_w * d_x, acc) and, apart, acc_min = fma(float(M),
    dmin_w * d_x, acc_min), I and M the pair's exact integers; the output acc - acc_min. m holds
    -dmin, so the second sum is -acc_min exactly (from -0) and the output is acc + it."""
    S = fmt_get(fmt, "sub")
    NS = fmt_get(fmt, "n_sub")
    n_sub_all = xs.shape[1] * 16 // S
    n_super = n_sub_all // NS
    sub_bytes = fmt_get(fmt, "sub_bytes")
    u1, u2, u3 = t + min(1, ng - 1), t + min(2, ng - 1), t + min(3, ng - 1)
    z = izero()
    f = vzero()
    nz = vbcast(np.float32(-0.0))
    a = (f, f, f, f, f, f, f, f)
    c = (nz, nz, nz, nz, nz, nz, nz, nz)
    for jp in range(n_sub_all // 2):  # a pair of sub-blocks (64 values) per float step
        B = jp * 2 // NS
        c0, c1, c2, c3 = (z, z, z, z), (z, z, z, z), (z, z, z, z), (z, z, z, z)
        for j in range(2 * jp, 2 * jp + 2):
            p = _sub_dot4(isa, fmt, q, (g * n_sub_all + j) * sub_bytes, x32, t, u1, u2, u3, j * S // 4)
            c0 = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, p[0], p[1], c0)
            c1 = _fold_sub(isa, fmt, sc, mn, xs, u1, j, g, n_sub_all, p[2], p[3], c1)
            c2 = _fold_sub(isa, fmt, sc, mn, xs, u2, j, g, n_sub_all, p[4], p[5], c2)
            c3 = _fold_sub(isa, fmt, sc, mn, xs, u3, j, g, n_sub_all, p[6], p[7], c3)
        a0, a1, b0, b1 = _fold_super_km(d, m, xd, t, B, g, n_super, c0, a[0], a[1], c[0], c[1])
        a2, a3, b2, b3 = _fold_super_km(d, m, xd, u1, B, g, n_super, c1, a[2], a[3], c[2], c[3])
        a4, a5, b4, b5 = _fold_super_km(d, m, xd, u2, B, g, n_super, c2, a[4], a[5], c[4], c[5])
        a6, a7, b6, b7 = _fold_super_km(d, m, xd, u3, B, g, n_super, c3, a[6], a[7], c[6], c[7])
        a = (a0, a1, a2, a3, a4, a5, a6, a7)
        c = (b0, b1, b2, b3, b4, b5, b6, b7)
    _store(y, ym, t, g, vadd(a[0], c[0]), vadd(a[1], c[1]))
    if ng > 1:
        _store(y, ym, u1, g, vadd(a[2], c[2]), vadd(a[3], c[3]))
    if ng > 2:
        _store(y, ym, u2, g, vadd(a[4], c[4]), vadd(a[5], c[5]))
    if ng > 3:
        _store(y, ym, u3, g, vadd(a[6], c[6]), vadd(a[7], c[7]))


@njit(cache=True, forceinline=True, _nrt=False)
def _row4_tl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym, ng):
    """_row4 (ng 1-4 tokens) in the float order of ggml-cpu's tiled K-quant matmul without mins
    (tiled/tiled-kernel.cpp's VNNI microtile, which llama.cpp takes for a q6_K matrix and 8 tokens
    or more): per super-block the exact integer I of _row4, then
    acc = fma(float(I) * d_w, d_x, acc) from +0 in block order (the microtile's
    buf + (float(I) * d) * d_x, its multiply and add contracted to one fma by the compiler: the
    build llama.cpp's x86 binaries are made with)."""
    S = fmt_get(fmt, "sub")
    NS = fmt_get(fmt, "n_sub")
    n_sub_all = xs.shape[1] * 16 // S
    n_super = n_sub_all // NS
    sub_bytes = fmt_get(fmt, "sub_bytes")
    u1, u2, u3 = t + min(1, ng - 1), t + min(2, ng - 1), t + min(3, ng - 1)
    z = izero()
    f = vzero()
    a = (f, f, f, f, f, f, f, f)
    for B in range(n_super):
        c0, c1, c2, c3 = (z, z, z, z), (z, z, z, z), (z, z, z, z), (z, z, z, z)
        for jj in range(NS):
            j = B * NS + jj
            p = _sub_dot4(isa, fmt, q, (g * n_sub_all + j) * sub_bytes, x32, t, u1, u2, u3, j * S // 4)
            c0 = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, p[0], p[1], c0)
            c1 = _fold_sub(isa, fmt, sc, mn, xs, u1, j, g, n_sub_all, p[2], p[3], c1)
            c2 = _fold_sub(isa, fmt, sc, mn, xs, u2, j, g, n_sub_all, p[4], p[5], c2)
            c3 = _fold_sub(isa, fmt, sc, mn, xs, u3, j, g, n_sub_all, p[6], p[7], c3)
        so = (g * n_super + B) * R
        d0, d1 = vscale(d, so), vscale(d, so + 16)
        e0, e1, e2, e3 = vbcast(xd[t, B]), vbcast(xd[u1, B]), vbcast(xd[u2, B]), vbcast(xd[u3, B])
        a = (
            vfma(vmul(itof(c0[0]), d0), e0, a[0]),
            vfma(vmul(itof(c0[1]), d1), e0, a[1]),
            vfma(vmul(itof(c1[0]), d0), e1, a[2]),
            vfma(vmul(itof(c1[1]), d1), e1, a[3]),
            vfma(vmul(itof(c2[0]), d0), e2, a[4]),
            vfma(vmul(itof(c2[1]), d1), e2, a[5]),
            vfma(vmul(itof(c3[0]), d0), e3, a[6]),
            vfma(vmul(itof(c3[1]), d1), e3, a[7]),
        )
    _store(y, ym, t, g, a[0], a[1])
    if ng > 1:
        _store(y, ym, u1, g, a[2], a[3])
    if ng > 2:
        _store(y, ym, u2, g, a[4], a[5])
    if ng > 3:
        _store(y, ym, u3, g, a[6], a[7])


@njit(cache=True, forceinline=True, _nrt=False)
def _row1_ord(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym):
    """One token of _row4_km (q4_K) or _row4_tl (q6_K): the same operations in the same order
    on _sub_dot's integers (one token's, without _row4's three spare slots), so the same bits."""
    S = fmt_get(fmt, "sub")
    NS = fmt_get(fmt, "n_sub")
    n_sub_all = xs.shape[1] * 16 // S
    n_super = n_sub_all // NS
    sub_bytes = fmt_get(fmt, "sub_bytes")
    z = izero()
    a0, a1 = vzero(), vzero()
    b0 = b1 = vbcast(np.float32(-0.0))
    if fmt_get(fmt, "kmin"):
        for jp in range(n_sub_all // 2):
            B = jp * 2 // NS
            c = (z, z, z, z)
            for j in range(2 * jp, 2 * jp + 2):
                base = (g * n_sub_all + j) * sub_bytes
                for o in range(0, sub_bytes, 64):
                    prefetch(q, base + PREFETCH_BYTES + o)
                i0, i1 = _sub_dot(isa, fmt, q, base, x32, t, j * S // 4)
                c = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, i0, i1, c)
            a0, a1, b0, b1 = _fold_super_km(d, m, xd, t, B, g, n_super, c, a0, a1, b0, b1)
        _store(y, ym, t, g, vadd(a0, b0), vadd(a1, b1))
    else:
        for B in range(n_super):
            c = (z, z, z, z)
            for jj in range(NS):
                j = B * NS + jj
                base = (g * n_sub_all + j) * sub_bytes
                for o in range(0, sub_bytes, 64):
                    prefetch(q, base + PREFETCH_BYTES + o)
                i0, i1 = _sub_dot(isa, fmt, q, base, x32, t, j * S // 4)
                c = _fold_sub(isa, fmt, sc, mn, xs, t, j, g, n_sub_all, i0, i1, c)
            so = (g * n_super + B) * R
            e = vbcast(xd[t, B])
            a0 = vfma(vmul(itof(c[0]), vscale(d, so)), e, a0)
            a1 = vfma(vmul(itof(c[1]), vscale(d, so + 16)), e, a1)
        _store(y, ym, t, g, a0, a1)


EXPAND_MIN_TOKENS = 16  # a chunk of at least this many tokens runs on its group's values expanded to bytes


@intrinsic
def _bytes_fmt(typingctx, fmt):
    """The QFormat of fmt's values held one unsigned byte each (nib and planes off): what
    _expand_group writes. A compile-time value, like fmt."""
    if not isinstance(fmt, QFormatType):
        return None
    t = QFormatType(fmt.fmt._replace(nib=False, planes=0))

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return t(fmt), codegen


@njit(cache=True, forceinline=True, _nrt=False)
def _expand_group(fmt, q, g, qx):
    """Row group g's nibble + bit-plane sub-blocks -> qx u8 [n_sub * S * R], one byte per value
    in the byte layout of kernels/qlayout.py ([S / 4 steps, R, 4] per sub-block): the same
    values, so the same integers and bits, without redoing the bit-plane ORs (one masked move
    per vector and plane) for every four tokens of a long chunk."""
    S = fmt_get(fmt, "sub")
    H = S // 8
    n_sub = q.shape[1]
    sub_bytes = fmt_get(fmt, "sub_bytes")  # a nibble format
    for j in range(n_sub):
        base = (g * n_sub + j) * sub_bytes
        out = j * S * R
        for s in range(H):
            l0, l1, h0, h1 = _nib_vectors(fmt, q, base, s)
            bstore(qx, out + s * 128, l0)
            bstore(qx, out + s * 128 + 64, l1)
            bstore(qx, out + (H + s) * 128, h0)
            bstore(qx, out + (H + s) * 128 + 64, h1)


def _run_expanded(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
    """Tokens t .. t1 - 1 of row group g on the group's values expanded to bytes when the format
    has bit planes, the chunk is long (EXPAND_MIN_TOKENS) and `expand` (a literal bool) allows it,
    or all of them in ggml's float order for a QFormat.lanes format (kernels/matmul_lanes.py);
    returns whether it ran them."""
    raise NotImplementedError


@overload(_run_expanded, inline="always")
def _run_expanded_impl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
    if not isinstance(fmt, QFormatType) or not isinstance(expand, types.BooleanLiteral):
        return None
    if fmt.fmt.lanes and fmt.fmt.n_sub > 1 and not fmt.fmt.kmin:  # every token in ggml's tiled q6_K order

        def impl_tl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
            while t < t1:
                ng = min(4, t1 - t)
                if ng == 1:
                    _row1_ord(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym)
                else:
                    _row4_tl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym, ng)
                t += ng
            return True

        return impl_tl
    if fmt.fmt.lanes and fmt.fmt.kmin:  # every token in ggml's repacked q4_K order

        def impl_km(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
            while t < t1:
                ng = min(4, t1 - t)
                if ng == 1:
                    _row1_ord(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym)
                else:
                    _row4_km(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, y, ym, ng)
                t += ng
            return True

        return impl_km
    if fmt.fmt.lanes:  # every token in ggml's lane order (q4_1, q5_0, q8_0: kernels/matmul_lanes.py)
        return lanes_impl(fmt.fmt)
    if fmt.fmt.planes == 0 or not expand.literal_value:  # nothing compiled: a second _row/_row4 per format
        return lambda isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand: False

    def impl(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
        if t1 - t < EXPAND_MIN_TOKENS:
            return False
        bf = _bytes_fmt(fmt)
        _expand_group(fmt, q, g, qx)
        while t + 4 <= t1:
            _row4(isa, bf, qx, d, m, sc, mn, x32, xd, xs, xm, t, g, 0, y, ym, 4, False)
            t += 4
        while t < t1:
            _row(isa, bf, qx, d, m, sc, mn, x32, xd, xs, xm, t, g, 0, y, ym)
            t += 1
        return True

    return impl


@njit(cache=True)
def _run_items(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, y, token_chunk, i0, i1, expand):
    """Work items i0 .. i1 - 1 (item = row group * n_chunks + token chunk): up to four tokens at
    a time through _row4, a lone last token through _row. A serial function, so that the
    parallel kernel's body stays small (numba's parfor passes are slow on big bodies).
    expand: a literal True or False, whether long chunks of a bit-plane format run on their
    values expanded to bytes (the same bits, faster on long chunks, but a second _row/_row4 to
    compile: matmul_q_serial, which a first run compiles before its first answer, goes without)."""
    n = y.shape[0]
    n_tc = (n + token_chunk - 1) // token_chunk
    ym = np.empty(R, np.float32)  # the last group's 32 sums before the partial store
    long_chunks = expand and fmt_get(fmt, "planes") > 0 and min(n, token_chunk) >= EXPAND_MIN_TOKENS
    n_qx = q.shape[1] * fmt_get(fmt, "sub") * R if long_chunks else 0  # one group's bytes
    if fmt_get(fmt, "lanes") and fmt_get(fmt, "n_sub") == 1:
        # kernels/matmul_lanes.py (inlined here: numba's cache key is this file's text, so a change
        # there needs one here): two tokens' f32 block scales, summs, outputs and lane corrections
        n_qx = ((2 * (q.shape[1] + 1) + 2) * R + 16 * q.shape[1]) * 4
    qx = np.empty(n_qx, np.uint8)
    # a chunk of a few tokens (a verify batch) streams each group's weights once: prefetch them;
    # a prompt's chunk re-reads them from cache for every four tokens (hints cost pp512 ~3 %)
    pf = min(n, token_chunk) <= PREFETCH_MAX_TOKENS
    for it in range(i0, i1):
        g = it // n_tc
        t = (it - g * n_tc) * token_chunk
        t1 = min(n, t + token_chunk)
        if _run_expanded(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, t1, g, y, ym, qx, expand):
            continue
        while t < t1:
            ng = min(4, t1 - t)
            if ng == 1:
                _row(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, g, y, ym)
            else:
                _row4(isa, fmt, q, d, m, sc, mn, x32, xd, xs, xm, t, g, g, y, ym, ng, pf)
            t += ng


@njit(cache=True, inline="always")
def _quantize_rows(x, act, parallel):
    """x f32 [n, k] -> (xq i8 [n, k], xd, xs, xm) in activation format act (kernels/quant_act.py)."""
    n, k = x.shape
    nbx = k // 256 if act == ACT_Q8_K else k // 32
    xq = np.empty((n, k), np.int8)
    xd = np.empty((n, nbx), np.float32)
    xs = np.empty((n, k // 16), np.int32)
    xm = np.empty((n, k // 32), np.float32)
    if parallel and n >= QUANT_ACT_PAR_MIN_ROWS:
        for t in prange(n):  # an i64 row index, as below: one compiled quantize_row_q8 for both
            quantize_row_q8(x, np.int64(t), act, xq, xd, xs, xm)
    else:
        for t in range(n):
            quantize_row_q8(x, t, act, xq, xd, xs, xm)
    return xq, xd, xs, xm


@njit(parallel=True, cache=True)
def matmul_q(isa, fmt, q, d, m, sc, mn, x, y, token_chunk, n_runs):
    """y f32 [n, m] = x f32 [n, k] (C-contiguous) @ W.T for W packed by kvchat.kernels.qlayout.repack_int.
    isa: kvchat.kernels.simd_int.Isa (the instruction path), fmt: the weight's QFormat. The (row group,
    token chunk) items are cut into n_runs runs, one prange iteration each; how they are cut
    never changes a result."""
    xq, xd, xs, xm = _quantize_rows(x, fmt_get(fmt, "act"), True)
    x32 = xq.view(np.int32)  # [n, k / 4]: four activation bytes per broadcast
    n = x.shape[0]
    n_tc = (n + token_chunk - 1) // token_chunk
    n_items = q.shape[0] * n_tc
    n_par = max(1, min(n_items, n_runs))
    for p in prange(n_par):
        _run_items(
            isa,
            fmt,
            q,
            d,
            m,
            sc,
            mn,
            x32,
            xd,
            xs,
            xm,
            y,
            token_chunk,
            p * n_items // n_par,
            (p + 1) * n_items // n_par,
            True,
        )


@njit(cache=True)
def matmul_q_serial(isa, fmt, q, d, m, sc, mn, x, y, token_chunk):
    """matmul_q on the calling thread only (small products: no parallel launch); same results."""
    xq, xd, xs, xm = _quantize_rows(x, fmt_get(fmt, "act"), False)
    n = x.shape[0]
    _run_items(
        isa,
        fmt,
        q,
        d,
        m,
        sc,
        mn,
        xq.view(np.int32),
        xd,
        xs,
        xm,
        y,
        token_chunk,
        np.int64(0),  # not the literal 0: that would type (and compile) _run_items a second time
        q.shape[0] * ((n + token_chunk - 1) // token_chunk),
        False,  # no byte expansion: one _row/_row4 to compile (see _run_items)
    )


@njit(cache=True)
def quantize_activations(x, act):
    """x f32 [n, k] -> (xq i8 [n, k], xd f32, xs i32 [n, k / 16], xm f32): what matmul_q multiplies
    (for tests and diagnostics; the kernels quantize inside the same call)."""
    return _quantize_rows(x, act, False)
