"""qwen3: the llama block with per-head RMSNorm of Q and K before RoPE (QK-norm) and neox RoPE.
The forward is llama's; QK-norm applies because every qwen3 layer has attn_q_norm/attn_k_norm
(hparams requires them)."""
from runtime.arch.llama import forward  # noqa: F401
