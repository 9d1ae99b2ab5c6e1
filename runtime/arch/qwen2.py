"""qwen2 (src/models/qwen2.cpp): the llama block with biases on Q, K and V (added after the
fused QKV matmul) and neox RoPE; the default layer loop."""

from kvchat.runtime.arch.base import Arch


class Qwen2(Arch):
    name = "qwen2"
    rope_type = "neox"


ARCH = Qwen2()
