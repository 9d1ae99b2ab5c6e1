"""olmoe (src/models/olmoe.cpp): OLMoE-1B-7B.

The llama block with neox RoPE and its own output matrix, with Q and K each RMS-normalized over the whole
projection (`attn_q_norm` / `attn_k_norm` of n_embd values: all heads at once, before RoPE; the
layer plan applies them as q_norm_full / k_norm_full), and a mixture-of-experts FFN in every
layer: softmax gating, the top-k weights *not* normalized, SiLU-GLU experts feed_forward_length
wide (runtime/arch/moe.py). Its layers are llama's with the MoE FFN.
"""

from kvchat.runtime.arch.base import QK_FUSION, QKV_FUSION, Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec
from kvchat.runtime.arch.moe import MoEHParams, moe_ffn_step, read_moe
from kvchat.runtime.arch.moe_schema import EXPERT_GATE_UP_FUSION, moe_tensors


class OLMoE(Arch):
    name = "olmoe"
    rope_type = "neox"
    full_rotary = True
    fusions = (QKV_FUSION, QK_FUSION, EXPERT_GATE_UP_FUSION)

    def read_hparams(self, gf, fields):
        if fields["n_head_kv"] != fields["n_head"]:  # k_norm spans n_embd values: llama.cpp's shape check
            gf.fail("olmoe.attention.head_count_kv", f"{fields['n_head_kv']} must equal head_count {fields['n_head']}")
        return MoEHParams(**read_moe(gf, self.name, fields, gating="softmax", norm=False, ff_is_n_ff=True))

    def layer_tensors(self, hp, il):
        p = f"blk.{il}."
        t = {k: v for k, v in super().layer_tensors(hp, il).items() if k not in ("w_gate", "w_up", "w_down")}
        t["q_norm_full"] = Tensor(p + "attn_q_norm.weight", (hp.n_embd_head_k * hp.n_head,))
        t["k_norm_full"] = Tensor(p + "attn_k_norm.weight", (hp.n_embd_k_gqa(il),))
        t.update(moe_tensors(hp, il))
        return t

    def layer_spec(self, hp, il):
        return LayerSpec(ffn=moe_ffn_step)


ARCH = OLMoE()
