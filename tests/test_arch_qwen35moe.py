"""qwen35moe (Qwen3.5's hybrid of gated delta-net and gated attention layers on the hybrid
memory, with an MoE FFN and a sigmoid-gated shared expert in every layer) against llama.cpp on
tests/moe_models.py's qwen35moe_s1 (the shared qwen35_s1 with MoE FFNs: 8 experts, top-2,
shared expert FFN 32; refs in tests/moe_refs/)."""

from kvchat.runtime.model import Model
from tests.helpers import arch_refs


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = "qwen35moe_s1"


def test_hybrid_layers_and_the_gated_shared_expert_are_loaded():
    m = Model.load(arch_refs.model_path("qwen35moe_s1"))
    try:
        hp = m.hparams
        assert [hp.is_recurrent(il) for il in range(4)] == [True, True, True, False]
        assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (8, 2, 64, 32)
        for L in m.weights.layers:
            assert L.w_gate_up_exps.n_expert == 8 and L.w_gate_inp_shexp.shape == (64,)
    finally:
        m.close()
