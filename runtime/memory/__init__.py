"""The model's memory (llama.cpp's `llama-memory*.cpp`, `llama-kv-*.cpp`): the interface every
memory implements (`interface.py`), KV cells and caches, the iSWA pair, cache updates (K-shift,
copies, compaction), the Hadamard rotation of quantized caches, and state i/o."""
