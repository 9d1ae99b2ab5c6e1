"""numpy emulations of ggml-cpu's float operation order (x86 build), for bit-exactness tests.

Written from reading ggml-cpu's x86 sources (ops.cpp, vec.h, simd-mappings.h): independent of
kernels/, element by element in numpy. ``fma32`` is an exact
single-rounding fused multiply-add on float32 values (float64 product and sum made
round-to-odd before the final rounding to float32, so no double rounding).
"""

from __future__ import annotations

import numpy as np


def fma32(a, b, c) -> np.ndarray:
    """float32 a * b + c with one rounding, for a * b exact in float64 (<= 53 product bits)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # TwoSum: the exact p + c is s + err
    odd = (s.view(np.uint64) & 1) == 1
    s = np.where((err != 0) & ~odd, np.nextafter(s, s + err), s)  # round to odd (53 >= 2 * 24 + 2)
    return s.astype(np.float32)


def rms_norm_reference(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """ggml's rms_norm (+ mul by w) on rows x f32 [n, d] (ops.cpp rms_norm_f32): sum of the f32
    squares in float64 in element order, mean = f32(sum / d), scale = 1 / sqrtf(mean + eps) in
    f32, y = (x * scale) * w."""
    x = np.asarray(x, np.float32)
    sq = (x * x).astype(np.float32).astype(np.float64)
    s = np.cumsum(sq, axis=-1)[..., -1]  # cumsum adds in order (np.sum is pairwise)
    mean = (s / x.shape[-1]).astype(np.float32)
    scale = (np.float32(1.0) / np.sqrt((mean + np.float32(eps)).astype(np.float32))).astype(np.float32)
    y = (x * scale[..., None]).astype(np.float32)
    return y if w is None else (y * np.asarray(w, np.float32)).astype(np.float32)


def _f32(v):
    return np.float32(float.fromhex(v))


def expf_reference_avx512(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX-512 form (vec.h), on float32 values: n = round(x log2 e) by the 1.5 * 2^23
    trick, b = x - n ln2 (two fused steps), a degree-5 polynomial in fused steps, then j * 2^n."""
    x = np.asarray(x, np.float32)
    r = _f32("0x1.8p23")
    z = fma32(x, _f32("0x1.715476p+0"), r)
    n = (z - r).astype(np.float32)
    b = fma32(-n, _f32("0x1.7f7d1cp-20"), fma32(-n, _f32("0x1.62e4p-1"), x))
    u = (b * b).astype(np.float32)
    p1 = fma32(_f32("0x1.0e4020p-7"), b, _f32("0x1.573e2ep-5"))
    p2 = fma32(_f32("0x1.555e66p-3"), b, _f32("0x1.fffdb6p-2"))
    j = fma32(fma32(p1, u, p2), u, fma32(_f32("0x1.ffffecp-1"), b, np.float32(1.0)))
    with np.errstate(over="ignore"):  # j * 2^n past float32's range is inf, as scalef gives
        res = (j.astype(np.float64) * np.exp2(np.clip(n, -300, 300).astype(np.float64))).astype(np.float32)
    alt = np.where(n <= 0, np.float32(0.0), np.float32(np.inf)).astype(np.float32)
    return np.where(np.abs(n) > 192, alt, res).astype(np.float32)


def expf_reference_avx2(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX2 + FMA form (vec.h): the same n and b, then k = 2^n from the bits of
    z << 23, j = the polynomial without its 1 (last step c1 * b, not fma(c1, b, 1)),
    result fma(j, k, k); lanes with |n| > 126: fma(s2, j, s2) * s1 (s1 = bits(g + 0x7f000000),
    s2 = bits(e - g), g = 0x82000000 where n <= 0), or s1 * s1 past |n| > 192."""
    x = np.asarray(x, np.float32)
    r = _f32("0x1.8p23")
    z = fma32(x, _f32("0x1.715476p+0"), r)
    with np.errstate(invalid="ignore"):
        n = (z - r).astype(np.float32)
    b = fma32(-n, _f32("0x1.7f7d1cp-20"), fma32(-n, _f32("0x1.62e4p-1"), x))
    e = (z.view(np.uint32).astype(np.uint64) << 23).astype(np.uint32)  # 32-bit shift: high bits drop
    k = (e.astype(np.uint64) + 0x3F800000).astype(np.uint32).view(np.float32)
    u = (b * b).astype(np.float32)
    p1 = fma32(_f32("0x1.0e4020p-7"), b, _f32("0x1.573e2ep-5"))
    p2 = fma32(_f32("0x1.555e66p-3"), b, _f32("0x1.fffdb6p-2"))
    j = fma32(fma32(p1, u, p2), u, (_f32("0x1.ffffecp-1") * b).astype(np.float32))
    g = np.where(n <= 0, np.uint64(0x82000000), np.uint64(0))
    s1 = ((g + 0x7F000000) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    s2 = ((e.astype(np.uint64) - g) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        big = np.where(np.abs(n) > 192, s1 * s1, (fma32(s2, j, s2) * s1).astype(np.float32))
    return np.where(np.abs(n) > 126, big, fma32(j, k, k)).astype(np.float32)


def expf_reference(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf in the form llama.cpp runs on this host (kernels/ggml_math.EXPF_AVX512)."""
    from kvchat.kernels.ggml_math import EXPF_AVX512

    return expf_reference_avx512(x) if EXPF_AVX512 else expf_reference_avx2(x)


def silu_reference(x: np.ndarray) -> np.ndarray:
    """ggml_v_silu: x / (1 + expf(0 - x))."""
    x = np.asarray(x, np.float32)
    return (x / (np.float32(1.0) + expf_reference((np.float32(0.0) - x).astype(np.float32)))).astype(np.float32)


def _libm():
    import ctypes

    lib = ctypes.CDLL("libm.so.6")
    for name, n in (("cosf", 1), ("sinf", 1), ("powf", 2)):
        getattr(lib, name).restype = ctypes.c_float
        getattr(lib, name).argtypes = [ctypes.c_float] * n
    return lib


def rope_reference(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, neox: bool) -> np.ndarray:
    """ggml's rope (ops.cpp rope cache + rotate_pairs as GCC contracts it) on x f32 [n, heads, d]:
    theta_scale = powf(base, -2.0f / n_rot); theta_0 = p, theta_{i+1} = theta_i * theta_scale in
    f32; (c, s) = (cosf, sinf)(theta_i) of libm; x0' = fma(x0, c, -(x1 s)), x1' = fma(x0, s, x1 c)."""
    lib = _libm()
    half = n_rot // 2
    ts = np.float32(lib.powf(np.float32(freq_base), np.float32(-2.0) / np.float32(n_rot)))
    cs = np.zeros((len(pos), half, 2), np.float32)
    for t, p in enumerate(pos):
        th = np.float32(p)
        for i in range(half):
            cs[t, i] = lib.cosf(th), lib.sinf(th)
            th = np.float32(th * ts)
    x = np.array(x, np.float32)
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    x0, x1 = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = fma32(x0, c, -(x1 * s).astype(np.float32))
    x[..., i1] = fma32(x0, s, (x1 * c).astype(np.float32))
    return x


def _tree16(x: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16 lanes): lanes i + (i + 8), then i + (i + 4), ..."""
    x = np.asarray(x, np.float32)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = (x[..., :h] + x[..., h:]).astype(np.float32)
    return x[..., 0]


def _to_f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _lane_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """llamafile's tinyBLAS f16 x f16 dot on AVX-512 (sgemm.cpp gemm_bloc): lane l an fma chain
    over elements l, l + 16, ... of the last axis (zero-padded to 16), then hsum (_tree16).
    a, b: [..., n] f32 broadcastable -> [...] f32."""
    a, b = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32))
    n = a.shape[-1]
    pad = -n % 16
    if pad:
        z = np.zeros(a.shape[:-1] + (pad,), np.float32)
        a, b = np.concatenate([a, z], -1), np.concatenate([b, z], -1)
    acc = np.zeros(a.shape[:-1] + (16,), np.float32)
    for e in range(0, n + pad, 16):
        acc = fma32(a[..., e : e + 16], b[..., e : e + 16], acc)
    return _tree16(acc)


def classic_attention_reference(q, k, v, mask, scale) -> np.ndarray:
    """llama.cpp's attention with flash attention off, f16 K and V caches, as ggml-cpu's AVX-512
    build computes it (llama-graph.cpp build_attn_mha: kq = mul_mat(k, q), soft_max_ext(kq, mask,
    scale), kqv = mul_mat(v, kq)):
    - KQ: mul_mat converts Q to K's vec-dot type (f16), then tinyBLAS's f16 dot (_lane_dot);
    - soft_max_f32 (ops.cpp): w = kq * scale + mask; e = ggml_v_expf(w - max); the exps of each
      16 cells (from cell 0) summed in one tree, those sums added in double in cell order;
      p = e * (float)(1.0 / sum);
    - KQV: mul_mat converts P to V's vec-dot type (f16), then the same lane dot over the cells.
    q [T, H, D] f32; k [n_kv, Hkv, D] and v [n_kv, Hkv, Dv] f16 values as f32; mask [T, n_kv] f32
    (0 / -inf, every row with a visible cell); n_kv a multiple of 16 (llama.cpp pads it to 256)
    -> [T, H * Dv] f32."""
    q = _to_f16(q)
    T, H, _ = q.shape
    n_kv, hkv, dv = v.shape
    g = H // hkv
    out = np.zeros((T, H, dv), np.float32)
    for h in range(H):
        kq = _lane_dot(k[None, :, h // g, :], q[:, h, None, :])  # [T, n_kv]
        w = ((kq * np.float32(scale)).astype(np.float32) + mask).astype(np.float32)
        x = (w - w.max(axis=1, keepdims=True)).astype(np.float32)
        ex = expf_reference(np.where(np.isinf(x), np.float32(-1e3), x))  # [T, n_kv]; ggml_v_expf(-inf) = 0
        sums = _tree16(ex.reshape(T, n_kv // 16, 16)).astype(np.float64)  # [T, n_kv / 16]
        total = np.zeros(T, np.float64)
        for c in range(sums.shape[1]):
            total = total + sums[:, c]
        p = _to_f16((ex * (1.0 / total).astype(np.float32)[:, None]).astype(np.float32))  # [T, n_kv]
        out[:, h, :] = _lane_dot(v[None, :, h // g, :].transpose(0, 2, 1), p[:, None, :])  # [T, Dv]
    return out.reshape(T, H * dv)


def flash_tiled_reference(q, k, v, mask, scale) -> np.ndarray:
    """llama.cpp's flash attention as ggml-cpu's tiled kernel computes it (ops.cpp
    ggml_compute_forward_flash_attn_ext_tiled: ubatches of >= 64 queries, f16/f32 K and V, no
    soft-cap, no sinks), AVX-512 build, per query row over 64-cell tiles from cell 0: scores one fma
    chain over the head in order (Q in f32) times scale plus mask; an all -inf tile skipped; where
    the max rises, acc and S times libm expf(M - M'); p = ggml_v_expf(score - M'), S = f32(S + the
    16-cell trees summed in double); acc[e] one fma chain over the cells, carried over the tiles;
    out = acc * (1.0f / S). q [T, H, D] f32; k [n_kv, Hkv, D], v [n_kv, Hkv, Dv] as f32; mask
    [T, n_kv] -> [T, H * Dv] f32."""
    import ctypes

    expf = _libm().expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    q = np.asarray(q, np.float32)
    T, H, D = q.shape
    n_kv, hkv, dv = v.shape
    g = H // hkv
    out = np.zeros((T, H, dv), np.float32)
    for t in range(T):
        for h in range(H):
            m_run, s_run = np.float32(-np.inf), np.float32(0.0)
            acc = np.zeros(dv, np.float32)
            for j0 in range(0, n_kv, 64):
                nj = min(64, n_kv - j0)
                kk = np.zeros((64, D), np.float32)
                kk[:nj] = k[j0 : j0 + nj, h // g]
                vv = np.zeros((64, dv), np.float32)
                vv[:nj] = v[j0 : j0 + nj, h // g]
                sc = np.zeros(64, np.float32)
                for e in range(D):
                    sc = fma32(np.full(64, q[t, h, e], np.float32), kk[:, e], sc)
                sc = (sc * np.float32(scale)).astype(np.float32)
                mk = np.full(64, -np.inf, np.float32)
                mk[:nj] = mask[t, j0 : j0 + nj]
                sc = (sc + mk).astype(np.float32)
                tmax = sc.max()
                if tmax == -np.inf:
                    continue
                m_new = max(m_run, tmax)
                if m_new > m_run:
                    ms = np.float32(expf(float(np.float32(m_run - m_new))))  # libm expf; 0 on the first tile
                    acc = (acc * ms).astype(np.float32)
                    s_run = np.float32(s_run * ms)
                m_run = m_new
                x = (sc - m_new).astype(np.float32)
                p = expf_reference(np.where(np.isinf(x), np.float32(-1e3), x))
                sd = 0.0
                for c in range(4):
                    sd += float(_tree16(p[16 * c : 16 * c + 16]))
                s_run = np.float32(float(s_run) + sd)
                for j in range(64):
                    acc = fma32(vv[j], np.full(dv, p[j], np.float32), acc)
            inv = np.float32(0.0) if s_run == 0 else np.float32(np.float32(1.0) / s_run)
            out[t, h] = (acc * inv).astype(np.float32)
    return out.reshape(T, H * dv)
