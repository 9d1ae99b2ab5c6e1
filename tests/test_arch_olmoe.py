"""olmoe (Q/K RMS-normalized over the whole projection, neox RoPE, own output matrix, softmax
gating without normalized weights) against llama.cpp on the tiny seeded model of
tests/moe_models.py (16 experts, top-4; refs in tests/moe_refs/)."""

from tests.helpers import arch_refs


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = "olmoe_s1"
    chat_name = "olmoe_s1_chat"
