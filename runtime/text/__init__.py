"""Text in and out of the model (llama.cpp's `llama-vocab.cpp`, `common/chat`): the vocabulary
and its SPM / BPE tokenizers, and the GGUF chat template."""
