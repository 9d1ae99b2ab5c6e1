"""The architecture seam: every registered arch is one self-contained module, and the generic
layers (hparams, model, memory interface) name no architecture."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvchat.runtime.arch import ARCHS, create_memory, expected_tensors, get_arch, read_hparams
from kvchat.runtime.arch.base import Arch, Schema
from kvchat.runtime.cparams import ContextParams, resolve_cparams
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.model import Model
from tests.helpers.gguf_factory import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(ARCHS))
def test_every_registered_module_declares_its_arch(name):
    arch = get_arch(name)
    assert isinstance(arch, Arch) and arch.name == name
    assert arch.rope_type in ("norm", "neox")
    assert callable(arch.forward) and callable(arch.create_memory) and callable(arch.read_hparams)


def test_generic_modules_name_no_architecture():
    names = [n for n in ARCHS]
    for rel in ("runtime/hparams.py", "runtime/model.py", "runtime/memory/interface.py", "runtime/context.py"):
        text = (ROOT / rel).read_text()
        code = re.sub(r'""".*?"""', "", text, flags=re.S)  # docstrings may mention examples
        code = "\n".join(line.split("#")[0] for line in code.splitlines())
        for n in names:
            assert not re.search(rf'["\']{n}["\']', code), f"{rel} names the architecture {n!r}"


def test_loaded_layers_hold_what_the_schema_declares(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "q.gguf", arch="qwen2", n_layer=2))
    hp = read_hparams(gf)
    schema = get_arch("qwen2").tensors(hp)
    assert isinstance(schema, Schema) and len(schema.layers) == 2
    assert set(schema.expected()) == set(expected_tensors(hp))
    m = Model.load(gf.path)
    L = m.weights.layers[1]
    # Q|K|V and gate|up share F32: fused at load, the parts left None, biases folded into one
    assert L.wqkv is not None and L.wq is None and L.wk is None and L.wv is None
    assert L.w_gate_up is not None and L.w_gate is None and L.w_up is None
    assert L.bqkv.shape == (hp.n_embd_head_k * hp.n_head + 2 * hp.n_embd_k_gqa(),)
    assert L.bq is None  # folded
    assert m.weights.output is m.weights.tok_embd  # tied
    m.close()


def test_memory_is_asked_of_the_arch(tmp_path):
    m = Model.load(write_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=3))
    cp = resolve_cparams(ContextParams(n_ctx=256), m.hparams)
    assert type(m.create_memory(cp)).__name__ == "KVCacheISWA"
    assert type(create_memory(m.hparams, cp)).__name__ == "KVCacheISWA"
    m.close()
