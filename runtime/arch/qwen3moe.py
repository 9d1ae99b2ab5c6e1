"""qwen3moe (src/models/qwen3moe.cpp): Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B.

qwen3's attention (per-head RMS QK-norm before neox RoPE) with a mixture-of-experts FFN in every
layer: softmax gating, the top-k weights normalized to sum 1 (runtime/arch/moe.py), SiLU-GLU
experts, no shared expert. Its layers are llama's with the MoE FFN (LayerSpec(ffn=moe_ffn_step)).
"""

from kvchat.runtime.arch.base import QK_FUSION, QKV_FUSION, Arch
from kvchat.runtime.arch.layer_plan import LayerSpec
from kvchat.runtime.arch.moe import MoEHParams, moe_ffn_step, read_moe
from kvchat.runtime.arch.moe_schema import EXPERT_GATE_UP_FUSION, moe_tensors


class Qwen3MoE(Arch):
    name = "qwen3moe"
    rope_type = "neox"
    qk_norm = True
    fusions = (QKV_FUSION, QK_FUSION, EXPERT_GATE_UP_FUSION)

    def read_hparams(self, gf, fields):
        return MoEHParams(**read_moe(gf, self.name, fields, gating="softmax", norm=True))

    def layer_tensors(self, hp, il):
        t = {k: v for k, v in super().layer_tensors(hp, il).items() if k not in ("w_gate", "w_up", "w_down")}
        t.update(moe_tensors(hp, il))
        return t

    def layer_spec(self, hp, il):
        return LayerSpec(ffn=moe_ffn_step)


ARCH = Qwen3MoE()
