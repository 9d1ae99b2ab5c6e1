"""qwen35moe (src/models/qwen35moe.cpp): Qwen3.5-35B-A3B and its relatives.

Qwen3.5's hybrid (gated delta-net layers and a gated full-attention layer every
full_attention_interval-th; runtime/arch/qwen35.py, hybrid memory) with a mixture-of-experts FFN
in every layer: softmax gating, the top-k weights normalized, SiLU-GLU experts
`expert_feed_forward_length` wide, plus a shared expert (`expert_shared_feed_forward_length`,
default feed_forward_length) scaled by sigmoid(ffn_gate_inp_shexp · x) (runtime/arch/moe.py).
Multi-token-prediction layers are refused as qwen35 refuses them.
"""

from dataclasses import dataclass

from kvchat.runtime.arch import qwen35
from kvchat.runtime.arch.base import QK_FUSION, QKV_FUSION, Tensor
from kvchat.runtime.arch.moe import MoEHParams, read_moe, with_moe
from kvchat.runtime.arch.moe_schema import EXPERT_GATE_UP_FUSION, moe_tensors


@dataclass
class Qwen35MoEHParams(qwen35.Qwen35HParams, MoEHParams):
    pass


class Qwen35MoE(qwen35.Qwen35):
    name = "qwen35moe"
    fusions = (QKV_FUSION, QK_FUSION, EXPERT_GATE_UP_FUSION)

    def read_hparams(self, gf, fields):
        hp = super().read_hparams(gf, fields)  # qwen35's: the linear layers' keys and checks
        moe = read_moe(gf, self.name, vars(hp), gating="softmax", norm=True)
        moe["n_ff_shexp"] = moe["n_ff_shexp"] or moe["n_ff"]
        return Qwen35MoEHParams(**moe)

    def layer_tensors(self, hp, il):
        t = {k: v for k, v in super().layer_tensors(hp, il).items() if k not in ("w_gate", "w_up", "w_down")}
        t.update(moe_tensors(hp, il, shared=True))
        t["w_gate_inp_shexp"] = Tensor(f"blk.{il}.ffn_gate_inp_shexp.weight", (hp.n_embd,))
        return t

    def layer_spec(self, hp, il):
        return with_moe(super().layer_spec(hp, il))


ARCH = Qwen35MoE()
