"""qwen3moe (QK-norm attention + softmax-gated top-k MoE with normalized weights) against
llama.cpp on the tiny seeded models of tests/moe_models.py (refs in tests/moe_refs/)."""

import numpy as np

from kvchat.runtime.model import Model
from tests.helpers import arch_refs


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = "qwen3moe_s1"  # 8 experts, top-2, head size 32 (n_head * 32 != n_embd)
    chat_name = "qwen3moe_s1_chat"


class TestAgainstLlamaCppSixteenExperts(arch_refs.ReferenceChecks):
    name = "qwen3moe_s2"  # 16 experts, top-4, n_embd 48, expert FFN 40

    test_a_q8_0_copy_runs_through_chat_and_run = None  # n_embd 48: no row a Q8_0 copy would quantize


def test_the_routing_decides_the_outputs():
    """Without the weight normalization the long prompt's log-probs leave llama.cpp's by far more
    than the tolerance: the references see the MoE routing, not only the attention."""
    ref = arch_refs.load_ref("qwen3moe_s1")
    entry = next(e for e in ref["logits"] if e["name"] == "long")
    m = Model.load(arch_refs.model_path("qwen3moe_s1"))
    try:
        assert m.hparams.n_expert == 8 and m.hparams.n_expert_used == 2 and m.hparams.n_ff_exp == 64
        m.hparams.expert_weights_norm = False
        m.__dict__.pop("_layer_plan", None), m.__dict__.pop("_layer_plans", None)
        lp = arch_refs.log_softmax(arch_refs.all_logits(m, entry["tokens"]))
        ours = [[(int(t), float(r[t])) for t in np.argsort(-r)[:200]] for r in lp]
        d, _ = arch_refs.compare_entry(entry, ours)
        assert d > 0.05
    finally:
        m.close()


def test_info_shows_the_experts_and_the_bytes_a_token_reads():
    from kvchat.cli.commands.info import model_rows
    from kvchat.runtime.arch import read_hparams
    from kvchat.runtime.arch.moe import token_read_bytes
    from kvchat.runtime.gguf.file import GGUFFile

    gf = GGUFFile(arch_refs.model_path("qwen3moe_s1"))
    try:
        hp = read_hparams(gf)
        experts = 3 * 3 * 8 * 64 * 64 * 4  # layers x (gate, up, down) x experts x 64 x 64 f32
        total = sum(t.nbytes for t in gf.tensors.values())
        assert token_read_bytes(gf, hp) == total - experts * 6 // 8  # 2 of 8 experts
        rows = dict(model_rows(gf, hp))
    finally:
        gf.close()
    assert rows["experts"] == "8 (2 used a token, no shared expert), expert FFN 64, gating softmax, weights normalized"
    assert rows["bytes a token reads"].startswith(f"{(total - experts * 6 // 8) / 1024:.2f} KiB of")
