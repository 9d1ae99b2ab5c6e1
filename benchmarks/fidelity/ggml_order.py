"""Scratch emulations of two of ggml-cpu's float orders that kvchat's kernels do not follow yet
(#24): installed into a kvchat process, they make its forward bit-identical to llama.cpp's
(AVX2 build, f16 cache, flash on, prefill) on SmolLM2, layer by layer. Slow (scalar numba):
for measurements, not for use. docs/performance.md, "Accuracy", has the numbers.

- ``q4_1_matmul``: ggml_vec_dot_q4_1_q8_1 (arch/x86/quants.c, AVX2): per output, 8 float lanes,
  lane l = the integer dot of values 4l .. 4l+3 of each 32-block, acc_l = fma(d_w * d_x, float(i),
  acc_l) over the blocks; then hsum_float_8 ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)); plus summs, the
  in-order f32 sum of m_w * s_x (exact products). The activations are q8_1 as
  kernels/quant_act.py makes them (already ggml's).
- ``flash_tiled``: ggml_compute_forward_flash_attn_ext_tiled (ops.cpp; ubatches of >= 64
  queries, f16 or f32 K/V): per query and 64-cell tile, each score one fma chain over dk from 0
  (simd_gemm), times scale, plus mask; the tile's max, then when it rises VKQ and S times libm
  expf(M_old - M_new); p = ggml_v_expf(s - M) (this host's form, kernels/ggml_math), S += the
  8-lane (AVX2) or 16-lane (AVX-512: AVX512F + AVX512DQ) trees of p summed in double
  (ggml_vec_soft_max_f32); VKQ[e] = one fma chain over the tile's 64 cells (masked p = 0
  included); out = VKQ * (1 / S).

``install()`` routes kvchat's Q4_1 QMatrix.matmul and its flash attention (f16 cache, one
stream, no rotation) through them; weight fusion and the weight cache are turned off so every
matrix keeps its file rows. ``fma32`` rounds the float64 sum once more (double rounding, rare).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

import kvchat.runtime.arch.layer_plan as lp
import kvchat.runtime.model as rm
from kvchat.kernels.ggml_math import EXPF_AVX512, expf_ggml
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.matmul import QMatrix
from kvchat.kernels.qlayout import ACT_Q8_1
from kvchat.kernels.quant_act import quantize_row_q8
from kvchat.kernels.quants_fp import bits_to_f32, f32_to_bits


def _hx(s):
    return np.float32(float.fromhex(s))


_L2E, _LN_HI, _LN_LO = _hx("0x1.715476p+0"), _hx("0x1.62e4p-1"), _hx("0x1.7f7d1cp-20")
_C5, _C4, _C3, _C2, _C1 = (
    _hx(v) for v in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")
)
_R = np.float32(12582912.0)  # 0x1.8p23
WIDE = EXPF_AVX512  # ggml_vec_soft_max_f32's AVX-512 form (16-lane groups) on this host, else its AVX2 one


@njit(cache=True, forceinline=True)
def fma32(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(cache=True)
def v_expf_avx2(x):
    """ggml_v_expf, AVX2 form (vec.h), one lane."""
    z = fma32(x, _L2E, _R)
    n = z - _R
    b = fma32(-n, _LN_LO, fma32(-n, _LN_HI, x))
    e = f32_to_bits(z) << np.uint32(23)
    k = bits_to_f32(e + np.uint32(0x3F800000))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, _C1 * b)
    if not (abs(n) > np.float32(126.0)):
        return fma32(j, k, k)
    g = np.uint32(0x82000000) if n <= 0 else np.uint32(0)
    s1 = bits_to_f32(g + np.uint32(0x7F000000))
    if abs(n) > np.float32(192.0):
        return s1 * s1
    s2 = bits_to_f32(e - g)
    return fma32(s2, j, s2) * s1


@njit(cache=True, parallel=True)
def q4_1_matmul(x, w, wd, wm, y):
    """y [n, m] = x [n, k] f32 times the Q4_1 rows w [m, k / 32 * 20] (wd, wm [m, k / 32]: their
    f16 d and m as f32), in ggml's AVX2 order (module docstring)."""
    n, k = x.shape
    nb = k // 32
    xq = np.zeros((n, k), np.int8)
    xd = np.zeros((n, nb), np.float32)
    xs = np.zeros((n, k // 16), np.int32)
    xm = np.zeros((n, nb), np.float32)
    for t in range(n):
        quantize_row_q8(x, t, ACT_Q8_1, xq, xd, xs, xm)
    for r in prange(w.shape[0]):
        acc = np.zeros(8, np.float32)
        for t in range(n):
            acc[:] = 0.0
            summs = np.float32(0.0)
            for b in range(nb):
                d = wd[r, b] * xd[t, b]
                summs += wm[r, b] * xm[t, b]
                for lane in range(8):
                    s = np.int32(0)
                    for i in range(4 * lane, 4 * lane + 4):
                        byte = w[r, b * 20 + 4 + i % 16]
                        s += (np.int32(byte & 15) if i < 16 else np.int32(byte >> 4)) * np.int32(xq[t, b * 32 + i])
                    acc[lane] = fma32(d, np.float32(s), acc[lane])
            y[t, r] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + summs


@njit(cache=True, parallel=True)
def flash_tiled(q, kc, vc, mask, n_head_kv, scale, out):
    """q [n, H, dk] f32, kc [n_kv, n_head_kv, dk] / vc [.., dv] f32 (the cache's f16 values),
    mask [n, n_kv] (0 / -inf) -> out [n, H, dv], in ggml's tiled order (module docstring)."""
    n, n_head, dk = q.shape
    dv = vc.shape[2]
    n_kv = mask.shape[1]
    gq = n_head // n_head_kv
    for th in prange(n * n_head):
        t, h = th // n_head, th % n_head
        hk = h // gq
        m_run = np.float32(-np.inf)
        s_run = np.float32(0.0)
        acc = np.zeros(dv, np.float32)
        kq = np.empty(64, np.float32)
        vals = np.empty(16, np.float32)
        for ic in range(0, n_kv, 64):
            nt = min(64, n_kv - ic)
            tmax = np.float32(-np.inf)
            for j in range(64):
                if j >= nt:
                    kq[j] = np.float32(-np.inf)
                    continue
                a = np.float32(0.0)
                for d in range(dk):
                    a = fma32(q[t, h, d], kc[ic + j, hk, d], a)
                a = a * scale + mask[t, ic + j]
                kq[j] = a
                tmax = max(tmax, a)
            if tmax == np.float32(-np.inf):
                continue
            m_new = max(m_run, tmax)
            if m_new > m_run:
                ms = np.float32(math.exp(np.float32(m_run - m_new)))  # libm expf
                for e in range(dv):
                    acc[e] = acc[e] * ms
                s_run = s_run * ms
            m_run = m_new
            sd = np.float64(0.0)
            if WIDE:  # AVX-512: 16 exps a tree (_mm512_reduce_add_ps), the trees summed in double
                for g0 in range(0, 64, 16):
                    for lane in range(16):
                        vals[lane] = expf_ggml(np.float32(kq[g0 + lane] - m_new))
                        kq[g0 + lane] = vals[lane]
                    for w in (8, 4, 2, 1):
                        for lane in range(w):
                            vals[lane] = vals[lane] + vals[lane + w]
                    sd += np.float64(vals[0])
            else:  # AVX2: 8 a tree (the _mm256 hsum)
                for g0 in range(0, 64, 8):
                    for lane in range(8):
                        vals[lane] = expf_ggml(np.float32(kq[g0 + lane] - m_new))
                        kq[g0 + lane] = vals[lane]
                    sd += np.float64(
                        ((vals[4] + vals[0]) + (vals[6] + vals[2])) + ((vals[5] + vals[1]) + (vals[7] + vals[3]))
                    )
            s_run = np.float32(np.float64(s_run) + sd)
            for e in range(dv):
                a = acc[e]
                for j in range(64):
                    a = fma32(kq[j], vc[ic + j, hk, e] if j < nt else np.float32(0.0), a)
                acc[e] = a
        inv = np.float32(1.0) / s_run if s_run != 0 else np.float32(0.0)
        for e in range(dv):
            out[t, h, e] = acc[e] * inv


def install(q4_1: bool = True) -> None:
    """Route kvchat's f16 flash attention and (q4_1) its Q4_1 matmuls through the emulations
    (module docstring). q4_1=False leaves Q4_1 to the kernel, which follows ggml's order itself
    now (kernels/matmul_lanes.py)."""
    load_group = rm.load_group
    rm.load_group = lambda gf, specs, fusions=(), packs=None: load_group(gf, specs, (), None)
    matmul = QMatrix.matmul

    def q41(self, x, min_macs=None):
        if self.t != int(GGMLType.Q4_1) or self.raw is None:
            return matmul(self, x, min_macs)
        if x.ndim == 1:
            return q41(self, x[None, :], min_macs)[0]
        if not hasattr(self, "_ggml_rows"):
            w = np.ascontiguousarray(self.raw)
            blocks = w.reshape(self.m, -1, 20)
            d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
            m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
            self._ggml_rows = (w, d, m)
        y = np.empty((x.shape[0], self.m), np.float32)
        q4_1_matmul(np.ascontiguousarray(x, dtype=np.float32), *self._ggml_rows, y)
        return y

    if q4_1:
        QMatrix.matmul = q41
    attend_io = lp.attend_io
    f16 = int(GGMLType.F16)

    def tiled(p, q, io, n_threads, kq_scale=None, par_min=None):
        plain = io.flash and io.view is None and not io.rot_k and not io.rot_v and p.softcap == 0
        if not (plain and io.type_k == f16 and io.type_v == f16):
            return attend_io(p, q, io, n_threads, kq_scale, par_min)
        n_kv, st = io.mask.shape[1], int(io.tok_stream[0])
        kc = np.ascontiguousarray(io.k[st, :n_kv]).view(np.float16).astype(np.float32).reshape(n_kv, p.n_head_kv, -1)
        vc = np.ascontiguousarray(io.v[st, :n_kv]).view(np.float16).astype(np.float32).reshape(n_kv, p.n_head_kv, -1)
        out = np.empty((q.shape[0], q.shape[1], vc.shape[2]), np.float32)
        scale = np.float32(p.kq_scale if kq_scale is None else kq_scale)
        mask = np.ascontiguousarray(io.mask, dtype=np.float32)
        flash_tiled(np.ascontiguousarray(q, dtype=np.float32), kc, vc, mask, p.n_head_kv, scale, out)
        return out.reshape(q.shape[0], -1)

    lp.attend_io = tiled
