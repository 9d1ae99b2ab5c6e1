"""What the tests share: fakes, factories and references (tests/helpers/<name>.py, imported as
tests.helpers.<name>). Tiny GGUF models (gguf_factory), stub models and memories (memory_stubs,
recurrent_stubs), llama.cpp's tiny references (arch_refs), numpy references of the kernels (qref,
ggml_order), the CLI in-process and in a pty (cli_inproc, pty_chat), a fake hub
(sources_fake_hub)."""
