"""gemma2 (src/models/gemma2.cpp): Gemma 2.

gemma3's block without QK-norm, plus soft-capping: embeddings scaled by sqrt(n_embd); each
layer x += post_attention_norm(attn(attn_norm(x))), x += post_ffw_norm(GeGLU(ffn_norm(x)));
attention scores s -> cap·tanh(s/cap) before the mask (attn_logit_softcapping, default 50) and
logits l -> cap·tanh(l/cap) (final_logit_softcapping, default 30). Sliding window on the layers
il % 2 == 0 (sliding_window_pattern default 2; window default 4096), with the iSWA cache. The
attention scale is 1/sqrt(head size), 1/sqrt(n_embd/n_head) for the 27B (46 layers); NEOX RoPE
(base 10000 unless the file says), rope.freq_base_swa for the sliding layers if given. The
head is always token_embd. GGUF norm weights already include Gemma's +1. GeGLU's GELU goes
through ggml's f16 table as llama.cpp's CPU build does, as gemma3's (exact tanh moves the
reference log-probs by up to 1.0e-2, the table by 2.7e-3; kernels/gelu_table.py).
"""

from __future__ import annotations

import math

from kvchat.runtime.arch.base import Arch
from kvchat.runtime.arch.gemma3 import GEMMA_LAYER, GemmaHParams, gemma_model_spec, post_norm_tensors
from kvchat.runtime.hparams import positive, swa_layers

SWA_PATTERN = 2  # layers il % 2 == 0 slide
N_SWA = 4096  # llama.cpp's default window for gemma 2


class Gemma2(Arch):
    name = "gemma2"
    rope_type = "neox"

    def read_hparams(self, gf, fields) -> GemmaHParams:
        k = lambda name: f"gemma2.{name}"  # noqa: E731
        n_layer = fields["n_layer"]
        fields["n_swa"] = gf.get_int(k("attention.sliding_window"), N_SWA, min_value=0)
        if fields["n_swa"] > 0:
            fields["swa_layers"], fields["swa_pattern"] = swa_layers(
                gf, k("attention.sliding_window_pattern"), n_layer, SWA_PATTERN
            )
        fields["rope_freq_base_swa"] = positive(gf, k("rope.freq_base_swa"), fields["rope_freq_base"])
        fields["attn_logit_softcap"] = gf.get_float(k("attn_logit_softcapping"), 50.0)
        if n_layer == 46:  # the 27B scales by n_embd / n_head
            fields["kq_scale"] = 1.0 / math.sqrt(fields["n_embd"] / fields["n_head"])
        fields["tied_output"] = True
        return GemmaHParams(
            **fields,
            embed_scale=math.sqrt(fields["n_embd"]),
            final_logit_softcap=gf.get_float(k("final_logit_softcapping"), 30.0),
        )

    def model_tensors(self, hp):
        t = super().model_tensors(hp)
        del t["output"]  # llama.cpp always uses token_embd as the head
        return t

    def layer_tensors(self, hp, il):
        t = super().layer_tensors(hp, il)
        t.update(post_norm_tensors(hp, il))
        return t

    def layer_spec(self, hp, il):
        return GEMMA_LAYER

    def model_spec(self, hp):
        return gemma_model_spec(hp)


ARCH = Gemma2()
