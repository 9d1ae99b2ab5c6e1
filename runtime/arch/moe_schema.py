"""The weights of the mixture-of-experts FFN (runtime/arch/moe.py) in an arch's tensor schema.

Kept apart from the block's computation so that the layer loop (runtime/arch/layer_plan.py),
which runs the block, and the schema types (runtime/arch/base.py), which the loop's module is
imported by, do not import each other.
"""

from __future__ import annotations

from kvchat.runtime.arch.base import Fuse, Tensor

EXPERT_GATE_UP_FUSION = Fuse("w_gate_up_exps", ("w_gate_exps", "w_up_exps"))


def moe_tensors(hp, il: int, *, router_bias=False, expert_biases=False, shared=False, selection_bias=False) -> dict:
    """The schema entries of layer il's MoE FFN (see the module); the flags make the optional
    parts required (gpt-oss: biases; qwen35moe: shared expert)."""
    e, f, n = hp.n_embd, hp.n_ff_exp, hp.n_expert
    p = f"blk.{il}."
    t = {
        "w_gate_inp": Tensor(p + "ffn_gate_inp.weight", (e, n)),
        "w_gate_exps": Tensor(p + "ffn_gate_exps.weight", (e, f, n)),
        "w_up_exps": Tensor(p + "ffn_up_exps.weight", (e, f, n)),
        "w_down_exps": Tensor(p + "ffn_down_exps.weight", (f, e, n)),
    }
    if router_bias:
        t["b_gate_inp"] = Tensor(p + "ffn_gate_inp.bias", (n,))
    if expert_biases:
        t["b_gate_exps"] = Tensor(p + "ffn_gate_exps.bias", (f, n))
        t["b_up_exps"] = Tensor(p + "ffn_up_exps.bias", (f, n))
        t["b_down_exps"] = Tensor(p + "ffn_down_exps.bias", (e, n))
    if selection_bias:
        t["exp_probs_b"] = Tensor(p + "exp_probs_b.bias", (n,))
    if shared:
        fs = hp.n_ff_shexp
        t["w_gate_shexp"] = Tensor(p + "ffn_gate_shexp.weight", (e, fs))
        t["w_up_shexp"] = Tensor(p + "ffn_up_shexp.weight", (e, fs))
        t["w_down_shexp"] = Tensor(p + "ffn_down_shexp.weight", (fs, e))
        t["w_gate_inp_shexp"] = Tensor(p + "ffn_gate_inp_shexp.weight", (e,), False)
    return t
