"""granitemoe (granite's four multipliers, normalized softmax top-k, an ungated shared expert)
against llama.cpp on the tiny seeded model of tests/moe_models.py (8 experts, top-3, shared
expert FFN 48; refs in tests/moe_refs/)."""

from kvchat.runtime.model import Model
from tests.helpers import arch_refs


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = "granitemoe_s1"
    chat_name = "granitemoe_s1_chat"


def test_the_shared_expert_and_the_multipliers_are_read():
    m = Model.load(arch_refs.model_path("granitemoe_s1"))
    try:
        hp = m.hparams
        assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (8, 3, 64, 48)
        assert (hp.embed_scale, hp.residual_scale, hp.logit_scale) == (2.0, 0.5, 0.5)
        L = m.weights.layers[0]
        assert L.w_down_shexp is not None and getattr(L, "w_gate_inp_shexp", None) is None
    finally:
        m.close()
