"""gemma3 (src/models/gemma3.cpp): embeddings scaled by sqrt(n_embd), QK-norm, RMSNorm before
and after both attention and FFN, GeGLU (tanh GELU read from ggml's f16 table, kernels/gelu_table.py), local RoPE
base on sliding-window layers.

Sliding-window layers attend through the SWA cache: the iSWA memory context routes cpy_k /
get_k / kq_mask by hparams.is_swa(il). SWA layout: `sliding_window_pattern` n (default 6: five
sliding layers then one global) or an explicit per-layer bool array. The attention scale is
1/sqrt(head size), or 1/sqrt(n_embd/n_head) for the 27B (62 layers); GGUF norm weights already
include Gemma's +1. Each post-norm, residual add and the norm after it run as one kernel in the
layer loop (runtime/arch/layer_plan.py, the "sandwich" norm kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec, ModelSpec, geglu_ffn
from kvchat.runtime.hparams import HParams, positive, swa_layers

SWA_PATTERN = 6  # default: layers il % 6 < 5 slide, every 6th layer is global


@dataclass
class GemmaHParams(HParams):
    """gemma2 and gemma3's extras: the embedding scale sqrt(n_embd) and the final logit soft-cap."""

    embed_scale: float = 1.0
    final_logit_softcap: float = 0.0


GEMMA_LAYER = LayerSpec(norm="sandwich", ffn=geglu_ffn, q_scaled=True)  # post-norms before both residual adds,
# GeGLU; Q scaled by f_attention_scale after RoPE (gemma2/3.cpp), attention at scale 1


def gemma_model_spec(hp: GemmaHParams) -> ModelSpec:
    return ModelSpec(embed_scale=hp.embed_scale, logit_softcap=hp.final_logit_softcap)


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

    def read_hparams(self, gf, fields) -> GemmaHParams:
        k = lambda name: f"gemma3.{name}"  # noqa: E731
        n_layer = fields["n_layer"]
        n_swa = gf.get_int(k("attention.sliding_window"), 0, min_value=0)
        if n_swa > 0:
            fields["swa_layers"], fields["swa_pattern"] = swa_layers(
                gf, k("attention.sliding_window_pattern"), n_layer, SWA_PATTERN
            )
            fields["rope_freq_base_swa"] = positive(gf, k("rope.freq_base_swa"), 10000.0)
        fields["n_swa"] = n_swa
        if n_layer == 62:  # the 27B model scales by n_embd / n_head instead of the head size
            fields["kq_scale"] = 1.0 / math.sqrt(fields["n_embd"] / fields["n_head"])
        return GemmaHParams(
            **fields,
            embed_scale=math.sqrt(fields["n_embd"]),
            final_logit_softcap=gf.get_float(k("final_logit_softcapping"), 0.0),
        )

    def layer_tensors(self, hp, il):
        t = super().layer_tensors(hp, il)
        t.update(post_norm_tensors(hp, il))
        return t

    def layer_spec(self, hp, il):
        return GEMMA_LAYER

    def model_spec(self, hp):
        return gemma_model_spec(hp)


ARCH = Gemma3()
