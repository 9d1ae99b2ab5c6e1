"""Graph pieces the mixers of the non-llama layers share (llama.cpp's llm_graph_context helpers):
optional weights, the Q/K/V projection of a layer read by role, attention over the cache of
already roped Q/K/V, and ggml's rounding of Q for a quantized K. The layer loop itself and its
llama-style steps are runtime/arch/layer_plan.py.

Every function takes and returns plain f32 arrays; K/V go to and come from the cache only
through the memory context of the ubatch (cpy_k / cpy_v / attn_io).
"""

from __future__ import annotations

import numpy as np

from kvchat.kernels.attention import round_q_to_vec_dot_type
from kvchat.kernels.ggml_types import GGMLType
from kvchat.runtime.arch.layer_plan import LayerPlan, project_qkv, scale_f32, store_and_attend


def opt(L, name: str):
    """An optional weight of a layer: None when the arch's schema does not declare it or the
    file lacks it (the layer namespaces hold only what the schema declares)."""
    return getattr(L, name, None)


def qkv_projection(L, h, sizes, min_macs: int | None = None):
    """Q, K, V rows of h ([n, n_embd] f32) -> three [n, size] f32 arrays (column views of a fused
    product when the layer has a fused QKV or QK matrix: layer_plan.project_qkv)."""
    a, b = sizes[0], sizes[0] + sizes[1]
    return project_qkv(opt(L, "wqkv"), opt(L, "wqk"), L.wq, L.wk, L.wv, opt(L, "bqkv"), h, a, b, min_macs)


def attend(p: LayerPlan, q, k, v, mctx, n_threads: int, kq_scale) -> np.ndarray:
    """Attention of roped q [n, n_head, dk] over the cache after storing this ubatch's k
    [n, n_head_kv, dk] and v [n, n_embd_v_gqa] through the memory context of layer p.il;
    returns [n, n_head * dv] f32."""
    return store_and_attend(p, q, k, v, mctx, mctx.attn_io(p.il), n_threads, scale_f32(kq_scale))


def round_q_like_ggml(q: np.ndarray, type_k: int, flash: bool = True) -> np.ndarray:
    """Q [n, n_head * dk] f32 rounded as ggml's CPU K·Q rounds it for a K cache of type_k.

    ggml converts Q to K's "vec_dot type" before the dot product: 8-bit blocks with an f16 scale
    (q8_0 / q8_1, the same values) for every quantized K, bf16 for a bf16 K, on both attention
    paths. For an f16 K it depends on the path: the classic one (flash off) is a mul_mat, which
    converts Q to f16 for every batch size (then llamafile's f16 x f16 gemm); ggml's flash
    attention keeps Q in f32 on its tiled prefill path (>= 64 queries) and rounds it to f16 only
    below that, and kvchat's flash kernel is one path for every batch size, so flash leaves an f16
    K's Q alone. The rounding is per row, so batch-invariant. (The forward's copy of this rule:
    runtime/arch/layer_plan.py, attend_io.)"""
    t = int(type_k)
    if t == int(GGMLType.F32) or (t == int(GGMLType.F16) and flash):
        return q
    return round_q_to_vec_dot_type(q, t)  # kernels/attention.py: the rounding itself
