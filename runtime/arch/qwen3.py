"""qwen3 (src/models/qwen3.cpp): the llama block with per-head RMSNorm of Q and K before RoPE
(QK-norm, attn_q_norm / attn_k_norm required in every layer) and neox RoPE; the default layer loop."""

from kvchat.runtime.arch.base import Arch


class Qwen3(Arch):
    name = "qwen3"
    rope_type = "neox"
    qk_norm = True


ARCH = Qwen3()
