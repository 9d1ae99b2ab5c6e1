"""Building blocks shared by the architecture forwards (llama.cpp's llm_graph_context helpers).

Every function takes and returns plain f32 arrays; K/V go to and come from the cache only
through the memory context of the ubatch (cpy_k / cpy_v / get_k / get_v / kq_mask).
"""
from __future__ import annotations

import numba
import numpy as np

from kernels.act import geglu, glu_fused, swiglu
from kernels.attention import attention
from kernels.attention import round_q_to_vec_dot_type
from kernels.gelu_table import geglu_f16_table
from kernels.ggml_types import GGMLType
from kernels.norm import rms_norm
from kernels.rope import prepare_qkv_planned, rope_plan
from runtime.memory.attn_rotation import rotate


def embed(model, tokens) -> np.ndarray:
    """Token embeddings [n_tokens, n_embd] f32, scaled by hparams.embed_scale (gemma)."""
    x = model.weights.tok_embd.get_rows(np.ascontiguousarray(tokens, dtype=np.int32))
    x = np.ascontiguousarray(x, dtype=np.float32)
    scale = model.hparams.embed_scale
    if scale != 1.0:
        x *= np.float32(scale)
    return x


def opt(L, name: str):
    """An optional weight of a layer: None when the arch's schema does not declare it or the
    file lacks it (the layer namespaces hold only what the schema declares)."""
    return getattr(L, name, None)


def qkv_projection(L, h, sizes):
    """Q, K, V rows of h ([n, n_embd] f32) -> three [n, size] f32 arrays (column views of one
    fused product when the layer has a fused QKV matrix)."""
    bqkv = opt(L, "bqkv")
    if opt(L, "wqkv") is not None:
        qkv = L.wqkv.matmul(h)  # [n, q + k + v] f32
        if bqkv is not None:
            qkv += bqkv
        a, b = sizes[0], sizes[0] + sizes[1]
        return qkv[:, :a], qkv[:, a:b], qkv[:, b:]
    q, k, v = L.wq.matmul(h), L.wk.matmul(h), L.wv.matmul(h)
    if bqkv is not None:
        a, b = sizes[0], sizes[0] + sizes[1]
        q += bqkv[:a]
        k += bqkv[a:b]
        v += bqkv[b:]
    return q, k, v


def self_attention(model, il, L, h, pos, mctx, kq_scale, n_threads=None):
    """Multi-head attention of layer il for the ubatch: returns [n_tokens, n_head * head_dim_v] f32
    (before the output projection). QK-norm is applied when the layer has q_norm / k_norm.
    n_threads: numba's thread count, which a forward pass reads once for all its layers."""
    hp = model.hparams
    sizes, rope, q_norm, k_norm = attention_plan(model, il, L, ctx_size(mctx))
    q, k, v = prepare_qkv_planned(*qkv_projection(L, h, sizes), hp.n_head, hp.n_head_kv,
                                  hp.n_embd_head_k, pos, rope, hp.rope_type == "neox",
                                  q_norm, k_norm, hp.norm_eps)
    return attend(model, il, q, k, v, mctx, kq_scale, n_threads)


def attention_plan(model, il, L, n_ctx_seq):
    """(Q/K/V widths, rope_plan, q_norm, k_norm) of layer il: constants of the model and of the
    context size (LongRoPE picks its factors by it), worked out once and kept on the model, so a
    generated token does not redo them 30 times."""
    plans = model.__dict__.setdefault("_attention_plans", {})
    key = (il, n_ctx_seq)
    plan = plans.get(key)
    if plan is None:
        hp = model.hparams
        dk = hp.n_embd_head_k
        sizes = (dk * hp.n_head, hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il))
        plan = plans[key] = (sizes, rope_plan(**hp.rope_args(il, n_ctx_seq)), opt(L, "q_norm"),
                             opt(L, "k_norm"))
    return plan


def attend(model, il, q, k, v, mctx, kq_scale, n_threads=None):
    """Attention of roped q [n, n_head, dk] over the cache after storing this ubatch's k
    [n, n_head_kv, dk] and v [n, n_embd_v_gqa] through the memory context of layer il;
    returns [n, n_head * dv] f32."""
    hp = model.hparams
    n = q.shape[0]
    rot_k, rot_v = mctx.get_rot(il)  # quantized caches hold Hadamard-rotated K/V
    if rot_k:
        q, k = rotate(q, rot_k), rotate(k, rot_k)
    if rot_v:
        v = rotate(v, rot_v)
    mctx.cpy_k(il, k.reshape(n, -1))
    mctx.cpy_v(il, v)
    k_cache, type_k = mctx.get_k(il)
    v_cache, type_v = mctx.get_v(il)
    q = round_q_like_ggml(q, type_k)
    mask, tok_stream = mctx.kq_mask(il)
    out = attention(q, k_cache, type_k, v_cache, type_v, mask, tok_stream, hp.n_head_kv,
                    kq_scale, hp.attn_logit_softcap, flash=not _v_trans(mctx, il),
                    n_threads=numba.get_num_threads() if n_threads is None else n_threads,
                    start=mctx.kq_start(il))
    return rotate(out, rot_v) if rot_v else out  # [n, n_head * dv]


def ctx_size(mctx) -> int:
    """Cells per sequence of the context (llama.cpp's n_ctx_seq: the KV cache's size), which
    picks LongRoPE's factor set; the base cache's for an iSWA context."""
    base = getattr(mctx, "ctx_base", mctx)
    kv = getattr(base, "kv", None)
    return int(kv.kv_size) if kv is not None else 0


def round_q_like_ggml(q: np.ndarray, type_k: int) -> np.ndarray:
    """Q [n, n_head * dk] f32 rounded as ggml's CPU K·Q rounds it for a K cache of type_k.

    ggml converts Q to K's "vec_dot type" before the dot product, on both attention paths: 8-bit
    blocks with an f16 scale (q8_0 / q8_1, the same values) for every quantized K, bf16 for a
    bf16 K. That rounding is part of llama.cpp's numbers for those caches (perplexity moves by
    a few tenths of a percent), so we apply it too; it is per row, so batch-invariant. An f16 K
    is left alone: llama.cpp rounds Q to f16 only on its small-batch path (< 64 queries), not on
    the tiled prefill path, and we keep one path for every batch size."""
    t = int(type_k)
    if t in (int(GGMLType.F32), int(GGMLType.F16)):
        return q
    return round_q_to_vec_dot_type(q, t)  # kernels/attention.py: the rounding itself


def _v_trans(mctx, il) -> bool:
    """Whether the V cache of layer il is stored transposed (flash attention off)."""
    f = getattr(mctx, "v_trans", None)
    if callable(f):
        return bool(f(il))
    return bool(f)


def output_projection(L, attn):
    out = L.wo.matmul(attn)  # [n, n_embd] f32
    if opt(L, "bo") is not None:
        out += L.bo
    return out


def feed_forward(L, h, n_ff, use_gelu, gelu_table=False):
    """Gated FFN: down(act(gate(h)) * up(h)); act = GELU (gemma) or SiLU. gelu_table: GELU as
    ggml's CPU computes it, through its f16 table (kernels/gelu_table.py)."""
    if gelu_table:
        if opt(L, "w_gate_up") is not None:
            gu = L.w_gate_up.matmul(h)  # [n, 2 * n_ff] f32
            a = geglu_f16_table(gu[:, :n_ff], gu[:, n_ff:])
        else:
            a = geglu_f16_table(L.w_gate.matmul(h), L.w_up.matmul(h))
    elif opt(L, "w_gate_up") is not None:
        a = glu_fused(L.w_gate_up.matmul(h), n_ff, use_gelu)
    else:
        g, u = L.w_gate.matmul(h), L.w_up.matmul(h)
        if opt(L, "b_gate") is not None:
            g += L.b_gate
        if opt(L, "b_up") is not None:
            u += L.b_up
        a = geglu(g, u) if use_gelu else swiglu(g, u)
    out = L.w_down.matmul(a)
    if opt(L, "b_down") is not None:
        out += L.b_down
    return out


def output_ids(ubatch) -> np.ndarray | None:
    """Indices of the ubatch tokens whose logits are wanted; None when all of them are."""
    flags = np.asarray(ubatch.output, dtype=bool)
    if flags.all():
        return None
    return np.flatnonzero(flags)


def logits(model, x) -> np.ndarray:
    """Final norm + lm head (+ final soft-cap): x [n_out, n_embd] -> [n_out, n_vocab] f32."""
    return lm_head(model, rms_norm(x, model.weights.output_norm, model.hparams.norm_eps))


def lm_head(model, h) -> np.ndarray:
    """lm head (+ final soft-cap) of the already normalized h [n_out, n_embd] -> [n_out, n_vocab] f32."""
    out = model.weights.output.matmul(h)
    cap = model.hparams.final_logit_softcap
    if cap:
        out = (np.tanh(out * np.float32(1.0 / cap)) * np.float32(cap)).astype(np.float32)
    return out


def decoder_layers(model, ubatch, mixer, project=None, ffn_norm: str = "ffn_norm", residual_scale=None):
    """The block loop granite and the hybrids share (llm_build_llama's shape; llama's own forward
    is this loop with each residual add fused into the next norm, kernels/fused_norm.py): per layer
    cur = mixer(il, L, attn_norm(x), pos); x += project(L, cur); x += SwiGLU FFN of
    <ffn_norm>(x) — each added output times residual_scale when one is given (granite). After the
    last layer's mixer only the output rows go on (llama.cpp's inp_out_ids), so project runs on
    those only. Returns logits f32 [n_outputs, n_vocab] (before any logit scale)."""
    hp = model.hparams
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32
    out_ids = output_ids(ubatch)
    last = hp.n_layer - 1
    rs = None if residual_scale is None else np.float32(residual_scale)
    for il, L in enumerate(model.weights.layers):
        h = rms_norm(x, L.attn_norm, hp.norm_eps)
        cur = mixer(il, L, h, pos)
        if il == last and out_ids is not None:
            cur, x = cur[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        if project is not None:
            cur = project(L, cur)
        x += cur if rs is None else cur * rs  # ffn_inp
        cur = feed_forward(L, rms_norm(x, getattr(L, ffn_norm), hp.norm_eps), hp.n_ff, use_gelu=False)
        x += cur if rs is None else cur * rs
    return logits(model, x)
