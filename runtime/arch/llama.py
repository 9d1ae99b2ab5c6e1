"""llama (SmolLM2, Llama 2/3, Mistral-style files) — and, through the optional pieces, qwen2/qwen3.

Per layer: x += Wo·attn(rope(Q), rope(K), V) of RMSNorm(x); x += down(silu(gate)·up) of
RMSNorm(x). Q/K/V biases (qwen2) and QK-norm (qwen3) apply when the layer has them. After the
last layer's attention only the rows of output tokens are carried on (llama.cpp's inp_out_ids).
"""
from __future__ import annotations

import numpy as np

from kernels.norm import rms_norm
from runtime.arch.blocks import embed, feed_forward, logits, output_ids, output_projection, self_attention


def forward(model, ubatch, mctx) -> np.ndarray:
    """Logits f32 [n_outputs, n_vocab] of one ubatch."""
    hp = model.hparams
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32
    out_ids = output_ids(ubatch)
    last = hp.n_layer - 1
    for il, L in enumerate(model.weights.layers):
        h = rms_norm(x, L.attn_norm, hp.norm_eps)
        attn = self_attention(model, il, L, h, pos, mctx, hp.kq_scale)  # [n, n_head*dv]
        if il == last and out_ids is not None:
            attn, x = attn[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        x += output_projection(L, attn)
        h = rms_norm(x, L.ffn_norm, hp.norm_eps)
        x += feed_forward(L, h, hp.n_ff, use_gelu=False)
    return logits(model, x)
