"""Building blocks shared by the architecture forwards (llama.cpp's llm_graph_context helpers).

Every function takes and returns plain f32 arrays; K/V go to and come from the cache only
through the memory context of the ubatch (cpy_k / cpy_v / get_k / get_v / kq_mask).
"""

from __future__ import annotations

import numba
import numpy as np

from kvchat.kernels.attention import round_q_to_vec_dot_type
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.norm import rms_norm
from kvchat.runtime.arch.layer_plan import attention_step, gated_ffn, layer_plan, store_and_attend


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
    n_threads: numba's thread count, which a forward pass reads once for all its layers.
    (runtime/arch/layer_plan.py: attention_step with the layer's plan.)"""
    p = layer_plan(model, il, ctx_size(mctx))
    return attention_step(p, h, pos, mctx, _threads(n_threads), np.float32(kq_scale))


def attend(model, il, q, k, v, mctx, kq_scale, n_threads=None):
    """Attention of roped q [n, n_head, dk] over the cache after storing this ubatch's k
    [n, n_head_kv, dk] and v [n, n_embd_v_gqa] through the memory context of layer il;
    returns [n, n_head * dv] f32."""
    p = layer_plan(model, il, ctx_size(mctx))
    return store_and_attend(p, q, k, v, mctx, mctx.attn_io(il), _threads(n_threads), np.float32(kq_scale))


def _threads(n_threads) -> int:
    return numba.get_num_threads() if n_threads is None else n_threads


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
    the tiled prefill path, and we keep one path for every batch size. (The forward's copy of
    this rule: runtime/arch/layer_plan.py, attend_io.)"""
    t = int(type_k)
    if t in (int(GGMLType.F32), int(GGMLType.F16)):
        return q
    return round_q_to_vec_dot_type(q, t)  # kernels/attention.py: the rounding itself


def output_projection(L, attn):
    out = L.wo.matmul(attn)  # [n, n_embd] f32
    if opt(L, "bo") is not None:
        out += L.bo
    return out


def feed_forward(L, h, n_ff, use_gelu):
    """Gated FFN of layer L: down(act(gate(h)) * up(h)); act = GELU (gemma) or SiLU
    (runtime/arch/layer_plan.py: gated_ffn)."""
    return gated_ffn(
        h,
        n_ff,
        use_gelu,
        opt(L, "w_gate_up"),
        opt(L, "w_gate"),
        opt(L, "w_up"),
        opt(L, "b_gate"),
        opt(L, "b_up"),
        L.w_down,
        opt(L, "b_down"),
    )


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
