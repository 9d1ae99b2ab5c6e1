"""granite (src/models/granite.cpp): IBM Granite 3.x dense models.

The llama block (NORM RoPE, SwiGLU, optional biases) with four multipliers from the GGUF:
- `embedding_scale`: token embeddings are multiplied by it (0 or absent = 1);
- `attention.scale`: the score scale, *instead of* 1/sqrt(head size) (0 or absent = that);
- `residual_scale`: the attention output and the FFN output of every block are multiplied by
  it before they are added to the residual stream (0 or absent = 1);
- `logit_scale` (required): the logits are divided by it.
`rope.scaling.finetuned` false switches RoPE off in every layer (llama.cpp reads it that way).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.norm import rms_norm
from runtime.arch.blocks import embed, feed_forward, logits, output_ids, output_projection, self_attention
from runtime.arch.llama import Llama
from runtime.hparams import HParams


@dataclass
class GraniteHParams(HParams):
    residual_scale: float = 1.0
    logit_scale: float = 1.0


def forward(model, ubatch, mctx) -> np.ndarray:
    """Logits f32 [n_outputs, n_vocab] of one ubatch."""
    hp = model.hparams
    rs = np.float32(hp.residual_scale)
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32, * embedding_scale
    out_ids = output_ids(ubatch)
    last = hp.n_layer - 1
    for il, L in enumerate(model.weights.layers):
        h = rms_norm(x, L.attn_norm, hp.norm_eps)
        attn = self_attention(model, il, L, h, pos, mctx, hp.kq_scale)  # [n, n_head*dv]
        if il == last and out_ids is not None:
            attn, x = attn[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        x = output_projection(L, attn) * rs + x  # ffn_inp
        h = rms_norm(x, L.ffn_norm, hp.norm_eps)
        x = feed_forward(L, h, hp.n_ff, use_gelu=False) * rs + x
    return logits(model, x) * np.float32(1.0 / hp.logit_scale)


class Granite(Llama):
    name = "granite"

    def read_hparams(self, gf, fields):
        k = lambda name: f"granite.{name}"  # noqa: E731
        logit_scale = gf.get_float(k("logit_scale"))
        if not logit_scale > 0:
            gf.fail(k("logit_scale"), f"{logit_scale} must be positive")
        attention_scale = gf.get_float(k("attention.scale"), 0.0)
        if attention_scale:
            fields["kq_scale"] = attention_scale
        fields["embed_scale"] = gf.get_float(k("embedding_scale"), 0.0) or 1.0
        if not gf.get_bool(k("rope.scaling.finetuned"), True):
            fields["rope_layers"] = [False] * fields["n_layer"]
        hp = super().read_hparams(gf, fields)  # llama's: rope_freqs
        return GraniteHParams(**vars(hp), residual_scale=gf.get_float(k("residual_scale"), 0.0) or 1.0,
                              logit_scale=logit_scale)

    forward = staticmethod(forward)


ARCH = Granite()
