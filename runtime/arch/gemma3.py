"""gemma3 (src/models/gemma3.cpp): embeddings scaled by sqrt(n_embd), QK-norm, RMSNorm before
and after both attention and FFN, GeGLU (tanh GELU), local RoPE base on sliding-window layers.

Sliding-window layers attend through the SWA cache: the iSWA memory context routes cpy_k /
get_k / kq_mask by hparams.is_swa(il). The attention scale is hparams.kq_scale (1/sqrt(head
size), or 1/sqrt(n_embd/n_head) for the 27B); GGUF norm weights already include Gemma's +1.
"""
from __future__ import annotations

import numpy as np

from kernels.norm import rms_norm
from runtime.arch.blocks import embed, feed_forward, logits, output_ids, output_projection, self_attention


def forward(model, ubatch, mctx) -> np.ndarray:
    hp = model.hparams
    eps = hp.norm_eps
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32, * sqrt(n_embd)
    out_ids = output_ids(ubatch)
    last = hp.n_layer - 1
    for il, L in enumerate(model.weights.layers):
        h = rms_norm(x, L.attn_norm, eps)
        attn = self_attention(model, il, L, h, pos, mctx, hp.kq_scale)
        if il == last and out_ids is not None:
            attn, x = attn[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        cur = rms_norm(output_projection(L, attn), L.post_attn_norm, eps)
        x = cur + x  # sa_out
        h = rms_norm(x, L.ffn_norm, eps)
        cur = rms_norm(feed_forward(L, h, hp.n_ff, use_gelu=True), L.post_ffn_norm, eps)
        x += cur
    return logits(model, x)
