"""gemma3 (src/models/gemma3.cpp): embeddings scaled by sqrt(n_embd), QK-norm, RMSNorm before
and after both attention and FFN, GeGLU (tanh GELU read from ggml's f16 table, kernels/gelu_table.py), local RoPE
base on sliding-window layers.

Sliding-window layers attend through the SWA cache: the iSWA memory context routes cpy_k /
get_k / kq_mask by hparams.is_swa(il). SWA layout: `sliding_window_pattern` n (default 6: five
sliding layers then one global) or an explicit per-layer bool array. The attention scale is
1/sqrt(head size), or 1/sqrt(n_embd/n_head) for the 27B (62 layers); GGUF norm weights already
include Gemma's +1.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from kvchat.kernels.fused_norm import norm_add_rms_norm
from kvchat.kernels.norm import rms_norm
from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.blocks import ctx_size, embed, lm_head, output_ids
from kvchat.runtime.arch.layer_plan import attention_step, ffn_step, layer_plans, output_step
from kvchat.runtime.hparams import HParams, positive, swa_layers

SWA_PATTERN = 6  # default: layers il % 6 < 5 slide, every 6th layer is global


def forward(model, ubatch, mctx) -> np.ndarray:
    """Logits f32 [n_outputs, n_vocab] (gemma3 and gemma2).

    Each post-norm, residual add and the norm after it run as one kernel
    (kernels/fused_norm.norm_add_rms_norm: the same arithmetic in one launch); each layer runs
    from its plan (runtime/arch/layer_plan.py)."""
    hp = model.hparams
    eps = hp.norm_eps
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    x = embed(model, ubatch.token)  # [n_tokens, n_embd] f32, * sqrt(n_embd): the residual stream
    out_ids = output_ids(ubatch)
    plans = layer_plans(model, ctx_size(mctx))
    last = hp.n_layer - 1
    n_threads = numba.get_num_threads()
    h = rms_norm(x, plans[0].L.attn_norm, eps)
    for p in plans:
        L = p.L
        attn = attention_step(p, h, pos, mctx, n_threads)
        if p.il == last and out_ids is not None:
            attn, x = attn[out_ids], x[out_ids]
            if x.shape[0] == 0:
                return np.zeros((0, hp.n_vocab), dtype=np.float32)
        h = norm_add_rms_norm(output_step(p, attn), L.post_attn_norm, x, L.ffn_norm, eps)
        ffn = ffn_step(p, h, True)
        w_next = plans[p.il + 1].L.attn_norm if p.il < last else model.weights.output_norm
        h = norm_add_rms_norm(ffn, L.post_ffn_norm, x, w_next, eps)
    return lm_head(model, h)


def post_norm_tensors(hp, il) -> dict:
    """The norms gemma applies to the attention and FFN outputs before their residual adds
    (gemma2 declares the same pair)."""
    p, e = f"blk.{il}.", hp.n_embd
    return {
        "post_attn_norm": Tensor(p + "post_attention_norm.weight", (e,)),
        "post_ffn_norm": Tensor(p + "post_ffw_norm.weight", (e,)),
    }


class Gemma3(Arch):
    name = "gemma3"
    rope_type = "neox"
    qk_norm = True

    def read_hparams(self, gf, fields) -> HParams:
        k = lambda name: f"gemma3.{name}"  # noqa: E731
        n_layer = fields["n_layer"]
        n_swa = gf.get_int(k("attention.sliding_window"), 0, min_value=0)
        if n_swa > 0:
            fields["swa_layers"], fields["swa_pattern"] = swa_layers(
                gf, k("attention.sliding_window_pattern"), n_layer, SWA_PATTERN
            )
            fields["rope_freq_base_swa"] = positive(gf, k("rope.freq_base_swa"), 10000.0)
        fields["n_swa"] = n_swa
        fields["embed_scale"] = math.sqrt(fields["n_embd"])
        fields["final_logit_softcap"] = gf.get_float(k("final_logit_softcapping"), 0.0)
        if n_layer == 62:  # the 27B model scales by n_embd / n_head instead of the head size
            fields["kq_scale"] = 1.0 / math.sqrt(fields["n_embd"] / fields["n_head"])
        return HParams(**fields)

    def layer_tensors(self, hp, il):
        t = super().layer_tensors(hp, il)
        t.update(post_norm_tensors(hp, il))
        return t

    forward = staticmethod(forward)


ARCH = Gemma3()
