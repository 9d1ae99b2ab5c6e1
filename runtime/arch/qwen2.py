"""qwen2: the llama block with biases on Q, K and V (added after the fused QKV matmul) and
neox RoPE (hparams). The forward is llama's; this module names the architecture."""
from runtime.arch.llama import forward  # noqa: F401  (Q/K/V biases are applied when present)
