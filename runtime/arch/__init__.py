"""Architecture registry: GGUF `general.architecture` -> module with `forward(model, ubatch, mctx)`."""
from runtime.arch import gemma3, llama, qwen2, qwen3

ARCHS = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3}
