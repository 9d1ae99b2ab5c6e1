"""gpt-oss (src/models/openai-moe.cpp, llama.cpp's LLM_ARCH_OPENAI_MOE): gpt-oss-20b, gpt-oss-120b.

llama's pre-norm block with:
- attention: Q/K/V with biases, neox RoPE with YaRN (rope.scaling.type "yarn": runtime/hparams.py,
  kernels/rope.py), scale 1/sqrt(n_rot), a learned sink logit per head that joins the softmax
  (`attn_sinks`, kernels/attention.py), output projection with bias; sliding-window attention on
  the layers il % 2 == 0 (sliding_window_pattern 2, window `attention.sliding_window`), full
  attention on the others, on the iSWA memory; rope.freq_base_swa for the sliding layers if given;
- the norm before the FFN is `post_attention_norm` (not a sandwich norm: llama's ffn_norm slot);
- a mixture-of-experts FFN in every layer (runtime/arch/moe.py): router with bias, the top-k of
  the raw logits then a softmax over those k (gating "softmax_weight"), experts with biases and
  the clamped SwiGLU (swiglu_oai: alpha 1.702, limit 7), weights not normalized;
- its own output matrix. Experts ship as MXFP4 (kernels/qlayout.py).
"""

from __future__ import annotations

import math

from kvchat.runtime.arch.base import QK_FUSION, QKV_FUSION, Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec
from kvchat.runtime.arch.moe import MoEHParams, moe_ffn_step, read_moe
from kvchat.runtime.arch.moe_schema import EXPERT_GATE_UP_FUSION, moe_tensors
from kvchat.runtime.hparams import positive, swa_layers

SWA_PATTERN = 2  # layers il % 2 == 0 slide (load_swa_pattern(ml, 2))


class GptOss(Arch):
    name = "gpt-oss"
    rope_type = "neox"
    rope_scaling_types = ("yarn",)
    moe_act = "swiglu_oai"
    fusions = (QKV_FUSION, QK_FUSION, EXPERT_GATE_UP_FUSION)

    def read_hparams(self, gf, fields):
        k = lambda name: f"{self.name}.{name}"  # noqa: E731
        fields["n_swa"] = gf.get_int(k("attention.sliding_window"), min_value=1)
        fields["swa_layers"], fields["swa_pattern"] = swa_layers(
            gf, k("attention.sliding_window_pattern"), fields["n_layer"], SWA_PATTERN
        )
        fields["rope_freq_base_swa"] = positive(gf, k("rope.freq_base_swa"), fields["rope_freq_base"])
        fields["rope_freq_scale_swa"] = fields["rope_freq_scale"]
        fields["kq_scale"] = 1.0 / math.sqrt(fields["n_rot"])
        return MoEHParams(**read_moe(gf, self.name, fields, gating="softmax_weight", norm=False))

    def layer_tensors(self, hp, il):
        p = f"blk.{il}."
        t = {k: v for k, v in super().layer_tensors(hp, il).items() if k not in ("w_gate", "w_up", "w_down")}
        t["ffn_norm"] = Tensor(p + "post_attention_norm.weight", (hp.n_embd,))
        t["bo"] = Tensor(p + "attn_output.bias", (hp.n_embd,))
        t["attn_sinks"] = Tensor(p + "attn_sinks.weight", (hp.n_head,))
        t.update(moe_tensors(hp, il, router_bias=True, expert_biases=True))
        return t

    def layer_spec(self, hp, il):
        return LayerSpec(ffn=moe_ffn_step)


ARCH = GptOss()
