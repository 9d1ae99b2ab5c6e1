"""Architecture registry: GGUF `general.architecture` -> the Arch of the module under
runtime/arch/ that holds that architecture's whole story (runtime/arch/base.py lists what a module
declares), and what needs the arch of a file: its hyper-parameters (`read_hparams`: the common
fields of kvchat.runtime.hparams, the arch's own on top, the tensors checked against its schema)
and its memory (`create_memory`).

Adding an architecture is one new module plus its loader and its line in ARCHS below. A module is
imported on first use: a dense model's process never imports the recurrent archs, their memories
and kernels (~30-50 ms of CPU at start-up, measured: docs/performance.md "Start-up"). The loaders
are plain imports inside functions, so the import test sees them as edges (tests/test_imports.py),
and kvchat.runtime.hparams is a leaf: no cycle to hide.
"""

from __future__ import annotations

from kvchat.kernels.ggml_types import TYPES, type_name
from kvchat.runtime.arch.base import Arch
from kvchat.runtime.hparams import HParams


def _llama() -> Arch:
    from kvchat.runtime.arch import llama

    return llama.ARCH


def _qwen2() -> Arch:
    from kvchat.runtime.arch import qwen2

    return qwen2.ARCH


def _qwen3() -> Arch:
    from kvchat.runtime.arch import qwen3

    return qwen3.ARCH


def _gemma3() -> Arch:
    from kvchat.runtime.arch import gemma3

    return gemma3.ARCH


def _mamba() -> Arch:
    from kvchat.runtime.arch import mamba

    return mamba.ARCH


def _lfm2() -> Arch:
    from kvchat.runtime.arch import lfm2

    return lfm2.ARCH


def _qwen35() -> Arch:
    from kvchat.runtime.arch import qwen35

    return qwen35.ARCH


def _smollm3() -> Arch:
    from kvchat.runtime.arch import smollm3

    return smollm3.ARCH


def _phi3() -> Arch:
    from kvchat.runtime.arch import phi3

    return phi3.ARCH


def _gemma2() -> Arch:
    from kvchat.runtime.arch import gemma2

    return gemma2.ARCH


def _granite() -> Arch:
    from kvchat.runtime.arch import granite

    return granite.ARCH


def _qwen3moe() -> Arch:
    from kvchat.runtime.arch import qwen3moe

    return qwen3moe.ARCH


def _olmoe() -> Arch:
    from kvchat.runtime.arch import olmoe

    return olmoe.ARCH


def _granitemoe() -> Arch:
    from kvchat.runtime.arch import granitemoe

    return granitemoe.ARCH


def _qwen35moe() -> Arch:
    from kvchat.runtime.arch import qwen35moe

    return qwen35moe.ARCH


def _gpt_oss() -> Arch:
    from kvchat.runtime.arch import gpt_oss

    return gpt_oss.ARCH


ARCHS = {  # general.architecture -> the loader of its Arch (the module's ARCH)
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "mamba": _mamba,
    "lfm2": _lfm2,
    "qwen35": _qwen35,
    "smollm3": _smollm3,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "granite": _granite,
    "qwen3moe": _qwen3moe,
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
    "qwen35moe": _qwen35moe,
    "gpt-oss": _gpt_oss,
}
_LOADED: dict[str, Arch] = {}


def get_arch(name: str) -> Arch:
    """The Arch object of a supported architecture (its module imported on first use); KeyError
    for any other name."""
    arch = _LOADED.get(name)
    if arch is None:
        arch = _LOADED[name] = ARCHS[name]()
    return arch


def is_supported(name: str) -> bool:
    return name in ARCHS


def unsupported_message(name: str) -> str:
    return f"architecture '{name}' is not supported; supported: {', '.join(ARCHS)}"


def read_hparams(gf, check_tensors: bool = True) -> HParams:
    """The file's hyper-parameters, read and validated: the common fields (its arch may read
    some its own way: Arch.read_common), the arch's own keys on top (an HParams subclass for its
    extras), then every weight against the arch's tensor schema. ModelFileError (one line: file,
    key, problem) on any violation."""
    if not is_supported(gf.arch):
        gf.fail("general.architecture", unsupported_message(gf.arch))
    arch = get_arch(gf.arch)
    hp = arch.read_hparams(gf, arch.read_common(gf))
    if check_tensors:
        validate_tensors(gf, hp)
    return hp


def expected_tensors(hp: HParams) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape in ggml ne order, required) for every weight the arch may use (its schema)."""
    return get_arch(hp.arch).tensors(hp).expected()


def validate_tensors(gf, hp: HParams) -> None:
    """Every required weight present, every known weight of the implied shape and of a format
    the kernels implement."""
    for name, (shape, required) in expected_tensors(hp).items():
        ti = gf.tensors.get(name)
        if ti is None:
            if required:
                gf.fail(f"tensor {name}", f"missing (required for {hp.arch})")
            continue
        if tuple(ti.shape) != shape:
            gf.fail(f"tensor {name}", f"shape {list(ti.shape)} does not match the metadata, expected {list(shape)}")
        if int(ti.ggml_type) not in TYPES:
            gf.fail(f"tensor {name}", f"type {type_name(ti.ggml_type)} is not supported by kvchat")


def create_memory(hparams, cparams):
    """The memory the model of `hparams` needs (llama_model::create_memory): asked of its arch.
    Hyper-parameters naming no registered architecture (test stubs) get the attention default."""
    arch = get_arch(hparams.arch) if is_supported(hparams.arch) else Arch()
    return arch.create_memory(hparams, cparams)
