"""qwen2 (src/models/qwen2.cpp): the llama block with biases on Q, K and V (added after the
fused QKV matmul) and neox RoPE; llama's forward."""

from kvchat.runtime.arch import llama
from kvchat.runtime.arch.base import Arch


class Qwen2(Arch):
    name = "qwen2"
    rope_type = "neox"

    forward = staticmethod(llama.forward)


ARCH = Qwen2()
