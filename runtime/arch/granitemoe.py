"""granitemoe (src/models/granite-moe.cpp, graph of src/models/granite.cpp): IBM Granite 3.x
MoE models (granite-3.x-1b-a400m, 3b-a800m) and Granite MoE Shared.

granite's block and its four multipliers (runtime/arch/granite.py: embedding, attention and
residual scales, logit scale) with a mixture-of-experts FFN in every layer: softmax gating, the
top-k weights normalized, SiLU-GLU experts feed_forward_length wide, and when
`expert_shared_feed_forward_length` is given an ungated shared expert added to the routed sum
(runtime/arch/moe.py). The residual scale multiplies the whole FFN output.
"""

from dataclasses import dataclass

from kvchat.runtime.arch import granite
from kvchat.runtime.arch.base import QK_FUSION, QKV_FUSION
from kvchat.runtime.arch.moe import MoEHParams, read_moe, with_moe
from kvchat.runtime.arch.moe_schema import EXPERT_GATE_UP_FUSION, moe_tensors


@dataclass
class GraniteMoEHParams(granite.GraniteHParams, MoEHParams):
    pass


class GraniteMoE(granite.Granite):
    name = "granitemoe"
    fusions = (QKV_FUSION, QK_FUSION, EXPERT_GATE_UP_FUSION)

    def read_hparams(self, gf, fields):
        hp = super().read_hparams(gf, fields)  # granite's multipliers
        return GraniteMoEHParams(**read_moe(gf, self.name, vars(hp), gating="softmax", norm=True, ff_is_n_ff=True))

    def layer_tensors(self, hp, il):
        drop = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
        t = {k: v for k, v in super().layer_tensors(hp, il).items() if k not in drop}
        t.update(moe_tensors(hp, il, shared=hp.n_ff_shexp > 0))
        t.pop("w_gate_inp_shexp", None)  # granite's shared expert has no gate
        return t

    def layer_spec(self, hp, il):
        return with_moe(super().layer_spec(hp, il))


ARCH = GraniteMoE()
