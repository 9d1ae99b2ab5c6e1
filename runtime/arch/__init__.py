"""Architecture registry: GGUF `general.architecture` -> the module under runtime/arch/ that
holds that architecture's whole story (runtime/arch/base.py lists what a module declares).

Adding an architecture is one new module plus one line in ARCHS. The modules are imported on
first use, so kvchat.runtime.hparams and kvchat.runtime.model can look an architecture up without importing
every forward pass (and without an import cycle: each arch module imports kvchat.runtime.hparams).
"""

from __future__ import annotations

import importlib

ARCHS = {  # general.architecture -> module kvchat.runtime.arch.<name> (its ARCH object)
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "mamba": "mamba",
    "lfm2": "lfm2",
    "qwen35": "qwen35",
    "smollm3": "smollm3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "granite": "granite",
}


def get_arch(name: str):
    """The Arch object of a supported architecture; KeyError for any other name."""
    return importlib.import_module(f"kvchat.runtime.arch.{ARCHS[name]}").ARCH


def is_supported(name: str) -> bool:
    return name in ARCHS


def unsupported_message(name: str) -> str:
    return f"architecture '{name}' is not supported; supported: {', '.join(ARCHS)}"


def create_memory(hparams, cparams):
    """The memory the model of `hparams` needs (llama_model::create_memory): asked of its arch.
    Hyper-parameters naming no registered architecture (test stubs) get the attention default."""
    if not is_supported(hparams.arch):  # the base Arch (runtime/arch/base.py), found like the others
        return importlib.import_module("kvchat.runtime.arch.base").Arch().create_memory(hparams, cparams)
    return get_arch(hparams.arch).create_memory(hparams, cparams)
